"""Flow-matching pure functions against hand-computed values."""

import math

import pytest
import torch

from pi0.models.flow import euler_integrate, flow_matching_pair, posemb_sincos, sample_time


def test_posemb_sincos_hand_computed():
    # dim 4 -> fraction [0, 1] -> periods [min, max] = [4e-3, 4.0]
    t = torch.tensor([0.0, 0.5])
    emb = posemb_sincos(t, 4)
    w = [2 * math.pi / 4e-3, 2 * math.pi / 4.0]
    expected = torch.tensor([[0, 0, 1, 1],
                             [math.sin(0.5 * w[0]), math.sin(0.5 * w[1]), math.cos(0.5 * w[0]), math.cos(0.5 * w[1])]])
    torch.testing.assert_close(emb, expected.float(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        posemb_sincos(t, 3)


def test_euler_visits_openpi_times_and_integrates():
    seen = []

    def v(x, t):
        seen.append(round(float(t[0]), 5))
        return torch.ones_like(x) * 2.0

    x0 = torch.zeros(2, 3, 1)
    out = euler_integrate(v, x0, 10)
    assert seen == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    torch.testing.assert_close(out, torch.full_like(x0, -2.0))  # x1 = x0 + sum(dt * 2) = -2


def test_euler_linear_velocity_hand_computed():
    # v = x: each step multiplies by (1 + dt) = 0.8 with 5 steps -> 0.8**5
    out = euler_integrate(lambda x, t: x, torch.ones(1, 1, 1), 5)
    assert abs(float(out) - 0.8**5) < 1e-6
    one = euler_integrate(lambda x, t: x * 0 + t[:, None, None], torch.zeros(1, 1, 1), 1)
    assert float(one) == -1.0  # single step at t=1 with dt=-1


def test_flow_matching_pair_and_time():
    a, n = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, -1.0]]])
    x_t, u = flow_matching_pair(a, n, torch.tensor([0.25]))
    torch.testing.assert_close(x_t, torch.tensor([[[0.25 * 3 + 0.75 * 1, 0.25 * -1 + 0.75 * 2]]]))
    torch.testing.assert_close(u, torch.tensor([[[2.0, -3.0]]]))
    t = sample_time(10_000, torch.Generator().manual_seed(0))
    assert t.min() >= 0.001 and t.max() <= 1.0
    # Beta(1.5, 1) has mean 0.6 -> 0.6 * 0.999 + 0.001
    assert abs(float(t.mean()) - (0.6 * 0.999 + 0.001)) < 0.01
