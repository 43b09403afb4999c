"""A cheaper update with the same numbers: with trainable=expert the frozen prefix runs once per window and step, or
not at all when collection's sampler kept its kv caches (``algo.reuse_prefix``), and the loss, the gradients and the
trained weights equal the full joint pass's (float32)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pi0.modeling_pi0 import default_norm_stats
from pi0.models.paligemma_with_expert import pack_kv_cache
from pi0.ript.collection import PREFIX_KEYS, RolloutGenerator, sde_collector
from pi0.ript.init_states import InitStateSampler
from pi0.ript.objectives import FlowMatchingObjective, PPOObjective, stack_prefixes
from pi0.ript.reward_function import BinarySuccessReward
from pi0.ript.trainer import RIPTTrainer, RLConfig, collection_windows
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy


def assert_same_training(a: dict, b: dict, start, atol: float, stray: tuple[float, float] | None = None) -> None:
    """Two runs' trained parameters {name: tensor} agree within ``atol``, and some moved from ``start``'s.

    ``stray`` = (share, bound): up to that share of a tensor's elements may differ by more than ``atol``, never by
    more than ``bound``: AdamW moves a weight whose gradient is near 0 by up to lr a step whatever the gradient's
    size, so float32 rounding that flips such a gradient's sign shows as a difference of up to lr."""
    moved = 0
    for n, p in a.items():
        if stray is None:
            torch.testing.assert_close(p, b[n], atol=atol, rtol=1e-4)
        else:
            diff = (p - b[n]).detach().abs()
            far = diff > atol + 1e-4 * b[n].abs()
            assert float(far.float().mean()) <= stray[0] and float(diff.max()) <= stray[1], (
                f"{n}: {int(far.sum())} of {diff.numel()} elements differ by more than {atol} (max {float(diff.max())})")
        moved += int(not torch.equal(p, dict(start.model.named_parameters())[n]))
    assert moved > 0


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
    assert_same_training(out[0], out[1], policy, atol=2e-5)


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


# ------------------------------------------------------------------ collection's prefix caches, reused by the update
def _batch(policy, windows):
    b = FlowMatchingObjective.collate(FlowMatchingObjective(policy), windows)
    return b["images"], b["img_masks"], b["lang_tokens"], b["lang_masks"], b["state"]


@pytest.mark.parametrize("path", ["eager", "fast", "fast_unfused"])
def test_sampler_returns_the_prefix_cache_of_encode_prefix(policy_and_windows, path):
    """``sample_actions_sde(return_prefix=True)``: per sample, the valid keys/values equal ``encode_prefix``'s (the
    fast sampler skips a camera masked in every sample and trims the prompt; those keys are masked in eager), and
    the chain is the one the call returns without it."""
    policy, windows = policy_and_windows
    pol = copy.deepcopy(policy)
    model = pol.model
    if path != "eager":
        model.enable_fast_sampling(fuse_layers=path == "fast")
    images, img_masks, tokens, tok_masks, state = _batch(pol, windows[:5])
    tok_masks = tok_masks.clone()
    tok_masks[0, 3:] = False  # one prompt shorter than the rest
    img_masks = [img_masks[0], torch.zeros_like(img_masks[1])]  # the wrist camera masked in every sample
    noise = torch.randn(5, model.cfg.action_horizon, model.cfg.action_dim, generator=torch.Generator().manual_seed(1))
    args = (images, img_masks, tokens, tok_masks, state, noise, 3, 1.0, 0)
    out = model.sample_actions_sde(*args, generator=torch.Generator().manual_seed(2), return_prefix=True)
    ref = model.sample_actions_sde(*args, generator=torch.Generator().manual_seed(2))
    assert "prefix" not in ref and torch.equal(out["chain"], ref["chain"])
    kv, pad = out["prefix"]
    cache, ref_pad = model.encode_prefix(images, img_masks, tokens, tok_masks)
    ref_kv = pack_kv_cache(cache)
    depth, k2, hd = len(cache), 2 * model.cfg.paligemma.num_kv_heads, model.cfg.paligemma.head_dim
    assert kv.shape[0] == 5 and kv.shape[1:2] + kv.shape[3:] == (depth, k2, hd) and pad.dtype == torch.bool
    if path != "eager":
        assert kv.shape[2] < ref_kv.shape[2]  # the masked camera's tokens are not in the fast sampler's cache
    for j in range(5):
        assert int(pad[j].sum()) == int(ref_pad[j].sum())
        torch.testing.assert_close(kv[j][:, pad[j]], ref_kv[j][:, ref_pad[j]], atol=1e-5, rtol=1e-5)


def test_stacked_prefixes_of_different_lengths_give_the_same_velocity(policy_and_windows):
    """Right-padding caches to the longest one (``stack_prefixes``) leaves each sample's velocity as it is alone."""
    policy, windows = policy_and_windows
    model = policy.model
    images, img_masks, tokens, tok_masks, state = _batch(policy, windows[:3])
    with torch.no_grad():
        prefixes = []
        for j, n in enumerate((tokens.shape[1], 5, 9)):  # each sample's cache of another length
            cache, pad = model.encode_prefix([im[j:j + 1] for im in images], [m[j:j + 1] for m in img_masks],
                                             tokens[j:j + 1, :n], tok_masks[j:j + 1, :n])
            prefixes.append((pack_kv_cache(cache)[0], pad[0]))
        x = torch.randn(3, model.cfg.action_horizon, model.cfg.action_dim, generator=torch.Generator().manual_seed(3))
        t = torch.full((3,), 0.7)
        together = model.denoise_step(*stack_prefixes(prefixes), state, x, t)
        for j, p in enumerate(prefixes):
            alone = model.denoise_step(*stack_prefixes([p]), state[j:j + 1], x[j:j + 1], t[:1])
            torch.testing.assert_close(together[j:j + 1], alone, atol=1e-5, rtol=1e-4)
    assert len({p[1].shape[0] for p in prefixes}) == 3


class AlternateReward(BinarySuccessReward):
    """Rollout k of a group scores k % 2, so that every group has advantages +-0.5."""

    def __call__(self, episode) -> float:
        return float(episode.sample_index % 2)


def _expert_trainer(policy, reuse: bool):
    pol = copy.deepcopy(policy)
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    cfg = RLConfig(objective="ppo", trainable="expert", num_groups=2, group_size=2, dynamic_sampling=False,
                   eval_every=0, reuse_prefix=reuse, opt=OptimizerConfig(minibatch_size=3, lr=1e-3, epochs=2))
    return RIPTTrainer(pol, runner, InitStateSampler({4: [0, 1]}), cfg)


@pytest.mark.parametrize("pi05", [False, True])
def test_update_on_collection_prefixes_trains_the_same_weights(policy_and_windows, monkeypatch, pi05):
    """trainable=expert: with ``algo.reuse_prefix`` the update never encodes a prefix (collection's caches serve it),
    and the same collection gives the same losses and trained weights as encoding the prefix again; the caches are
    released after the update. pi0.5: no state token in the cache, the time condition in the expert's norms."""
    policy, _ = policy_and_windows
    if pi05:
        torch.manual_seed(0)
        policy = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=2, action_horizon=4, n_action_steps=2,
                                                   num_steps=3, pi05=True), default_norm_stats(8, 7))
    runs = []
    for reuse in (True, False):
        tr = _expert_trainer(policy, reuse)
        assert tr.rollouts.policy.record_prefix == reuse
        calls = []
        encode = tr.policy.model.encode_prefix
        monkeypatch.setattr(tr.policy.model, "encode_prefix", lambda *a, **k: calls.append(1) or encode(*a, **k))
        try:
            seen = []
            step = tr.update.step
            tr.update.step = lambda ws, **k: seen.append(sum("_prefix" in w for w in ws)) or step(ws, **k)
            tr.rollouts.reward = AlternateReward()  # the tiny start never succeeds; the loss needs advantages
            st = tr.step()
        finally:
            tr.runner.close()
        eps = [ep for g in tr.last_collection.groups for ep in g.episodes]
        n_windows = sum(len(ep.decisions) for ep in eps)
        assert st["train/windows"] == n_windows > 0 and st["train/steps"] > 0
        assert seen == [n_windows if reuse else 0]
        assert (not calls) == reuse  # reuse: no prefix pass in the update (collection's fast sampler made them)
        assert not any(k.startswith("_prefix") for ep in eps for d in ep.decisions for k in d.extras)
        runs.append((st, dict(tr.policy.model.named_parameters())))
    (st_a, w_a), (st_b, w_b) = runs
    assert st_a["rollout/success_rate"] == st_b["rollout/success_rate"]
    for key in ("train/loss", "train/ratio_mean", "train/approx_kl"):
        assert st_a[key] == pytest.approx(st_b[key], abs=1e-5, rel=1e-4)
    # AdamW moves a near-zero gradient's weight by up to lr (1e-3) a step whatever its size, so float32 rounding of
    # such a gradient shows as a few 1e-5, or on some CPUs (AMD EPYC: 1 of 8,192 elements at 1.15e-4) a little more:
    # a tenth of one step, but for at most 0.1% of a tensor, each within one step
    assert_same_training(w_a, w_b, policy, atol=1e-4, stray=(1e-3, 1e-3))


def test_no_prefix_is_recorded_when_the_prefix_trains(policy_and_windows):
    policy, _ = policy_and_windows
    pol = copy.deepcopy(policy)
    pol.model.set_trainable("all")
    col = sde_collector(pol, 1.0, 0, torch.Generator().manual_seed(0), record_prefix=True)
    runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=4)
    try:
        eps = runner.run([(4, 0)], group_size=2, policy=col)
    finally:
        runner.close()
    assert eps and not any(k in d.extras for ep in eps for d in ep.decisions for k in PREFIX_KEYS)
