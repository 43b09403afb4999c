"""bench/rl_drift.py: the split of an update's action move into the part LOOP's ratio sees (the stochastic step's
mean) and the part it does not (the other denoising steps), checked by hand on constant velocity fields."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

N, DT, C = 5, 0.2, 0.7  # 5 denoising steps, d = 1/5, Q's velocity offset


def zero(j: int, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


def offset_at(step: int):
    return lambda j, x: torch.full_like(x, C) if j == step else torch.zeros_like(x)


def start_chain(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """P (v = 0) at noise level 1, stochastic step k: Euler steps keep x; the step's mean is x - coef x (x1_hat = x
    for v = 0, and at t = 1 for any v) with coef = sigma^2 d / (2 t), sigma = sqrt(t / (1 - t)) (1 - t := d at
    t = 1), so coef = 0.5 at t = 1 (sigma^2 = 5) and at t = 0.8 (sigma^2 = 4); std = sigma sqrt(d): 1 at t = 1,
    2 sqrt(0.2) at t = 0.8."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    std = 1.0 if k == 0 else 2 * math.sqrt(DT)
    x1 = 0.5 * x0 + std * eps
    chain = torch.stack([x0] * (k + 1) + [x1] * (N - k), 1)  # (B, N+1, H, A)
    return chain, x0, eps, std


def test_a_later_step_moves_the_action_unseen_by_the_ratio():
    from rl_drift import recorded_noise, split_drift

    chain, x0, eps, _ = start_chain(0)
    assert torch.allclose(recorded_noise(zero, chain, 0, 1.0), eps, atol=1e-6)
    parts = split_drift(zero, offset_at(2), x0, eps, 0, N, 1.0)
    assert torch.allclose(parts["start"], chain[:, -1], atol=1e-6)
    assert torch.allclose(parts["std"], torch.tensor(1.0))
    assert torch.allclose(parts["mean_shift"], torch.zeros_like(x0))  # step 0 unchanged: ratio 1, KL 0
    assert torch.allclose(parts["seen"], parts["start"])
    assert torch.allclose(parts["moved"] - parts["seen"], torch.full_like(x0, -DT * C))  # one Euler step of v = c
    assert torch.allclose(parts["scored_q"] - parts["scored_p"], torch.full_like(x0, -DT * C))


def test_the_stochastic_steps_move_is_seen_and_its_kl_is_by_hand():
    from rl_drift import drift_figures, drift_sums, split_drift

    _, x0, eps, _ = start_chain(0)
    parts = split_drift(zero, offset_at(0), x0, eps, 0, N, 1.0)
    # mean_Q - mean_P = -d c - coef (1 - t) c, and x1_hat's 1 - t is 0 at t = 1 (only sigma takes 1 - t := d): -d c
    assert torch.allclose(parts["mean_shift"], torch.full_like(x0, -DT * C))
    assert torch.allclose(parts["seen"] - parts["start"], torch.full_like(x0, -DT * C), atol=1e-6)
    assert torch.allclose(parts["moved"], parts["seen"])
    assert torch.allclose(parts["scored_q"] - parts["scored_p"], torch.full_like(x0, -DT * C))  # the Euler step
    mask = torch.zeros_like(x0)
    mask[:, :2, :3] = 1.0  # 2 executed rows x 3 env dims per decision
    fig = drift_figures(drift_sums(parts, mask))
    assert fig["seen"] == pytest.approx(DT * C, rel=1e-5)
    assert fig["unseen"] == pytest.approx(0.0, abs=1e-6)
    assert fig["moved"] == pytest.approx(DT * C, rel=1e-5)
    assert fig["kl"] == pytest.approx(6 * (DT * C) ** 2 / 2, rel=1e-5)  # 6 entries of d^2 / (2 std^2), std 1
    assert fig["unseen_share"] == pytest.approx(0.0, abs=1e-9)
    # per executed dim (the 4th is never executed): the Euler step's move -d c, its RMS d c
    assert fig["scored_mean_per_dim"] == pytest.approx([-DT * C] * 3, rel=1e-5)
    assert fig["scored_rms_per_dim"] == pytest.approx([DT * C] * 3, rel=1e-5)


def test_the_trained_policys_own_steps_before_k_are_unseen():
    from rl_drift import drift_figures, drift_sums, recorded_noise, split_drift

    chain, x0, eps, std = start_chain(1)
    assert torch.allclose(recorded_noise(zero, chain, 1, 1.0), eps, atol=1e-6)
    parts = split_drift(zero, offset_at(0), x0, eps, 1, N, 1.0)
    assert torch.allclose(parts["std"], torch.tensor(std))
    assert torch.allclose(parts["seen"], parts["start"])  # step 1's mean at P's x_1 is unchanged
    # Q: x_1 = x0 - d c, then the step's mean halves it: the action moves by -0.5 d c
    assert torch.allclose(parts["moved"] - parts["start"], torch.full_like(x0, -0.5 * DT * C), atol=1e-6)
    fig = drift_figures(drift_sums(parts, torch.ones_like(x0)))
    assert fig["unseen_share"] == pytest.approx(1.0)
    assert fig["unseen"] == pytest.approx(0.5 * DT * C, rel=1e-5)


def test_p_and_q_swap_signs():
    """Measured against a trained P instead of the start: Q = the start moves every part back."""
    from rl_drift import split_drift

    _, x0, eps, _ = start_chain(0)
    fwd = split_drift(zero, offset_at(0), x0, eps, 0, N, 1.0)
    back = split_drift(offset_at(0), zero, x0, eps, 0, N, 1.0)
    assert torch.allclose(back["mean_shift"], -fwd["mean_shift"])
    assert torch.allclose(back["moved"] - back["start"], -(fwd["moved"] - fwd["start"]), atol=1e-6)


def test_bad_input_is_a_one_line_error_before_any_work(tmp_path):
    from rl_drift import main

    with pytest.raises(SystemExit, match="has no rl_improvement.json"):
        main(["--run", str(tmp_path)])
    (tmp_path / "rl_improvement.json").write_text("{}")
    with pytest.raises(SystemExit, match="--arm must be an arm the report ran"):
        main(["--run", str(tmp_path), "--arm", "ppo"])
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "arm.json").write_text("{}")
    with pytest.raises(SystemExit, match="--against must be start or previous"):
        main(["--run", str(tmp_path), "--against", "last"])


def test_drift_states_never_reach_the_held_out_ones(tmp_path):
    from rl_drift import main

    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "arm.json").write_text("{}")
    (tmp_path / "rl_improvement.json").write_text(json.dumps({"config": {"val_start": 1500, "eval_start": 2000}}))
    with pytest.raises(SystemExit, match=r"--states must be in 1..500 .*got 501"):
        main(["--run", str(tmp_path), "--states", "501"])
