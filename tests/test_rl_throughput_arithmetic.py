"""bench/rl_throughput.py --count_flops: the FLOP formulas by hand, the meter on a linear layer and on CPU attention
(forward and backward), the replay of the recorded products, and the per-iteration arithmetic from counts."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


def test_flop_formulas_by_hand():
    from rl_throughput import attention_flops, matmul_flops

    assert matmul_flops("mm", [(5, 3), (3, 4)]) == 2 * 5 * 3 * 4
    assert matmul_flops("addmm", [(5, 3), (3, 4)]) == 120  # the bias add is not a product
    assert matmul_flops("bmm", [(2, 5, 3), (2, 3, 4)]) == 240
    # q (B=2, N=4, T=3, H=8), one key/value head over S=5 keys: Q K^T and P V, 2 B N T S H each
    assert attention_flops((2, 4, 3, 8), (2, 1, 5, 8)) == 2 * (2 * 2 * 4 * 3 * 5 * 8)


def test_meter_counts_a_linear_layer_forward_and_backward():
    from rl_throughput import FlopMeter

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 4)
    x = torch.randn(5, 3, requires_grad=True)
    meter = FlopMeter()
    with meter.count() as mode:
        layer(x).sum().backward()
    # forward x W^T + b (addmm), backward dX = dY W (mm) and dW = dY^T X (mm): 120 each
    assert mode.get_total_flops() == 3 * 120
    assert sum(meter.shapes.values()) == 3
    assert meter.shapes[("addmm", ((5, 3), (3, 4)))] == 1
    assert {op for op, _ in meter.shapes} == {"addmm", "mm"}


def test_meter_counts_cpu_attention_with_grouped_heads():
    from rl_throughput import FlopMeter, attention_flops

    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, requires_grad=True)
    v = torch.randn(2, 1, 5, 8, requires_grad=True)
    bias = torch.zeros(2, 1, 3, 5)
    fwd = attention_flops(q.shape, k.shape)
    meter = FlopMeter()
    with meter.count() as mode:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert mode.get_total_flops() == fwd  # the fused CPU op, which the stock counter leaves at 0
    with meter.count() as mode:
        out.sum().backward()
    assert mode.get_total_flops() == 2 * fwd
    assert not meter.shapes  # attention is counted, not replayed as a matrix product


def test_replay_times_every_recorded_product():
    from rl_throughput import FlopMeter

    meter = FlopMeter()
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with meter.count():
        for _ in range(3):
            a @ b
        torch.bmm(torch.randn(2, 8, 4), torch.randn(2, 4, 6))
    seconds, flops = meter.replay_seconds()
    assert flops == 3 * 2 * 64 * 32 * 16 + 2 * 2 * 8 * 4 * 6
    assert seconds > 0


def test_arithmetic_per_iteration_from_counts():
    from rl_throughput import arithmetic

    rows = [{"decisions": 100.0, "windows": 40.0}, {"decisions": 300.0, "windows": 60.0}]  # means: 200, 50
    summary = {"per_iteration": rows, "iterations": 2, "policy_s_per_iter": 1.5, "update_s": 0.5}
    counted = {"flops_per_decision": 1e7, "flops_per_window": 4e7,
               "matmul_flops_per_decision": 5e6, "matmul_flops_per_window": 2e7,
               "matmul_replay_s_per_decision": 1e-4, "matmul_replay_s_per_window": 4e-4}
    a = arithmetic(summary, counted)
    assert a["gflop_collect"] == pytest.approx(2.0) and a["gflop_update"] == pytest.approx(2.0)
    assert a["gflop_iter"] == pytest.approx(4.0)
    # products replayed: 1 GFLOP + 1 GFLOP in 0.02 + 0.02 s -> 50 GFLOP/s; 4 GFLOP at that rate: 0.08 s
    assert a["matmul_gflops_alone"] == pytest.approx(50.0)
    assert a["floor_s"] == pytest.approx(0.08)
    assert a["model_s"] == pytest.approx(2.0) and a["model_gflops"] == pytest.approx(2.0)
