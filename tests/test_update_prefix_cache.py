"""A cheaper update with the same numbers: with trainable=expert the frozen prefix runs once per window and step, and
the loss, the gradients and the trained weights equal the full joint pass's (float32)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pi0.modeling_pi0 import default_norm_stats
from pi0.ript.collection import RolloutGenerator, sde_collector
from pi0.ript.init_states import InitStateSampler
from pi0.ript.objectives import FlowMatchingObjective, PPOObjective
from pi0.ript.trainer import collection_windows
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy


@pytest.fixture(scope="module")
def policy_and_windows():
    torch.manual_seed(0)
    policy = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=2, action_horizon=4, n_action_steps=2,
                                               num_steps=3), default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        gen = RolloutGenerator(runner, sde_collector(policy, 1.0, 0, torch.Generator().manual_seed(0)),
                               InitStateSampler({4: [0, 1]}), group_size=2, dynamic_sampling=False, max_attempts=1)
        col = gen.collect(2)
    finally:
        runner.close()
    # the groups' advantages are 0 when both rollouts fail: give them hand-set ones so the loss has a gradient
    for g in col.groups:
        g.advantages = np.array([1.0, -1.0])
    ppo = PPOObjective(policy, 1.0)
    return policy, collection_windows(ppo, col)


def _grads(objective, windows, mode: str):
    """-> (loss, {name: grad}) of one minibatch of ``windows``; ``mode``: "joint" (the reference), "inline" (the
    frozen prefix encoded without gradient inside ``predict_velocity``) or "attached" (``attach_prefixes``)."""
    model = objective.policy.model
    model.zero_grad(set_to_none=True)
    model.cache_frozen_prefix = mode != "joint"  # the reference: no cache anywhere, the same parameters train
    if mode == "attached":
        assert objective.attach_prefixes(windows, batch_size=3)
    try:
        batch = objective.collate(windows)
        assert ("prefix" in batch) == (mode == "attached")
        loss, _ = objective.loss(batch, torch.Generator().manual_seed(5))
        loss.backward()
    finally:
        objective.detach_prefixes(windows)
        model.cache_frozen_prefix = True
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["ppo", "flow"])
def test_cached_prefix_gives_the_same_loss_and_gradients(policy_and_windows, kind):
    policy, windows = policy_and_windows
    policy = copy.deepcopy(policy)
    policy.model.set_trainable("expert")
    assert policy.model.prefix_frozen()
    objective = PPOObjective(policy, 1.0) if kind == "ppo" else FlowMatchingObjective(policy)
    ws = [dict(w) for w in windows]
    loss_full, g_full = _grads(objective, ws, "joint")
    assert g_full and not any(n.startswith("paligemma_with_expert.paligemma.") for n in g_full)  # the expert's only
    for mode in ("inline", "attached"):
        loss, g = _grads(objective, ws, mode)
        assert loss == pytest.approx(loss_full, abs=1e-5, rel=1e-5)
        assert g.keys() == g_full.keys()
        for n in g_full:
            torch.testing.assert_close(g[n], g_full[n], atol=1e-5, rtol=1e-4)


def test_frozen_prefix_is_encoded_once_without_gradient(policy_and_windows, monkeypatch):
    """trainable=expert under gradient: predict_velocity encodes the prefix once, without gradient, and nothing of
    SigLIP or the VLM enters the autograd graph (the joint pass would carry the prefix stream through backward)."""
    policy, windows = policy_and_windows
    pol = copy.deepcopy(policy)
    model = pol.model.set_trainable("expert")
    objective = PPOObjective(pol, 1.0)
    calls, tracked = [], []
    encode = model.encode_prefix

    def counting(*a, **k):
        calls.append(torch.is_grad_enabled())
        return encode(*a, **k)

    monkeypatch.setattr(model, "encode_prefix", counting)
    hook = model.paligemma_with_expert.paligemma.register_forward_hook(
        lambda mod, inp, out: tracked.append(any(isinstance(o, torch.Tensor) and o.requires_grad
                                                 for o in (out if isinstance(out, tuple) else (out,)))))
    try:
        loss, _ = objective.loss(objective.collate(windows[:4]), torch.Generator().manual_seed(5))
    finally:
        hook.remove()
    assert calls == [False] and loss.requires_grad
    assert not any(tracked)


def test_update_with_epochs_trains_the_same_weights_and_frees_the_caches(policy_and_windows):
    policy, windows = policy_and_windows
    out = []
    for cache in (True, False):
        pol = copy.deepcopy(policy)
        pol.model.set_trainable("expert")
        objective = PPOObjective(pol, 1.0)
        pol.model.cache_frozen_prefix = cache  # False: the reference, the full joint pass every epoch
        ws = [dict(w) for w in windows]
        PolicyUpdate(objective, OptimizerConfig(lr=1e-3, epochs=3, minibatch_size=4), seed=0).step(ws)
        assert not any("_prefix" in w for w in ws)
        out.append(dict(pol.model.named_parameters()))
    moved = 0
    for n, p in out[0].items():
        torch.testing.assert_close(p, out[1][n], atol=2e-5, rtol=1e-4)
        moved += int(not torch.equal(p, dict(policy.model.named_parameters())[n]))
    assert moved > 0


def test_no_cache_when_the_prefix_trains(policy_and_windows):
    policy, windows = policy_and_windows
    pol = copy.deepcopy(policy)
    pol.model.set_trainable("all")
    assert not pol.model.prefix_frozen()
    ws = [dict(w) for w in windows]
    assert not PPOObjective(pol, 1.0).attach_prefixes(ws) and not any("_prefix" in w for w in ws)


def test_warmup_and_lr_scale_shrink_the_first_adamw_steps(policy_and_windows):
    """AdamW's first step moves every parameter with a gradient by about lr (m / sqrt(v) = ±1): with
    ``warmup_steps=4`` by lr / 4, with ``lr_scale=0.5`` by lr / 2; a step's lr is restored afterwards."""
    policy, windows = policy_and_windows
    moves = []
    for warmup, scale in ((0, 1.0), (4, 1.0), (0, 0.5)):
        pol = copy.deepcopy(policy)
        upd = PolicyUpdate(FlowMatchingObjective(pol), OptimizerConfig(lr=1e-3, minibatch_size=64, max_grad_norm=0,
                                                                       warmup_steps=warmup), seed=0)
        upd.lr_scale = scale
        before = [p.detach().clone() for p in upd.params]
        assert upd.step(windows, max_steps=1)["steps"] == 1
        moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(upd.params, before)])
        moves.append(float(moved[moved > 0].median()))
        assert upd.optimizer.param_groups[0]["lr"] == 1e-3 and upd.num_applied == 1
    assert moves[0] == pytest.approx(1e-3, rel=0.05)
    assert moves[1] / moves[0] == pytest.approx(0.25, rel=0.05)
    assert moves[2] / moves[0] == pytest.approx(0.5, rel=0.05)
