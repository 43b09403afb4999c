"""FPO (``algo.objective=fpo``): the surrogate log-density by hand, the draws pass equal to M plain flow losses, and an
iteration whose first ratio is 1 and whose update moves the weights."""

from __future__ import annotations

import pytest
import torch

from pi0.ript.objectives import fpo_log_density


def test_fpo_log_density_by_hand():
    """Two draws of squared errors 1 and 3 on the two masked entries, 5 on the unmasked one: the draws' mean is 2 per
    masked entry, -1/2 x (2 + 2) = -2; a window with nothing masked in is 0."""
    sq = torch.tensor([[[[1.0, 1.0, 5.0]], [[3.0, 3.0, 5.0]]]])  # (B=1, M=2, H=1, A=3)
    mask = torch.tensor([[[1.0, 1.0, 0.0]]])
    torch.testing.assert_close(fpo_log_density(sq, mask), torch.tensor([-2.0]))
    torch.testing.assert_close(fpo_log_density(sq, torch.zeros_like(mask)), torch.tensor([0.0]))
    # the log-ratio is the drop in the loss: halving every error of the masked entries raises it by +1
    assert float(fpo_log_density(sq / 2, mask) - fpo_log_density(sq, mask)) == pytest.approx(1.0)


@pytest.mark.parametrize("trainable", ["all", "expert"])
def test_flow_loss_draws_equals_plain_losses(trainable):
    """One prefix pass + M*B suffix rows give forward()'s loss at each draw, in value and in gradient."""
    from pi0.policies.presets import synthetic_observation, tiny_policy

    policy = tiny_policy(seed=1)
    model = policy.model.set_trainable(trainable)
    inp = policy.prepare_inputs(synthetic_observation(policy, 2))
    args = (inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"], inp["state"])
    g = torch.Generator().manual_seed(1)
    h = model.cfg.action_horizon
    actions = torch.randn(2, h, model.cfg.action_dim, generator=g)
    noise = torch.randn(2, 3, h, model.cfg.action_dim, generator=g)
    time = torch.rand(3 * 2, generator=g).reshape(2, 3) * 0.9 + 0.05
    draws = model.flow_loss_draws(*args, actions, noise, time)
    assert draws.shape == (2, 3, h, model.cfg.action_dim)
    grads = torch.autograd.grad(draws.sum(), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    plain = torch.stack([model(*args, actions, noise=noise[:, j], time=time[:, j]) for j in range(3)], 1)
    torch.testing.assert_close(draws, plain, atol=1e-5, rtol=1e-5)
    ref = torch.autograd.grad(plain.sum(), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    moved = 0
    for p, a, b in zip([p for p in model.parameters() if p.requires_grad], grads, ref):
        a = torch.zeros_like(p) if a is None else a  # unused by the cached path (the VLM's last norm): 0 in both
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        moved += int(bool(a.abs().sum() > 0))
    assert moved > 0
    with pytest.raises(ValueError, match="do not fit actions"):
        model.flow_loss_draws(*args, actions, noise, time[:, :2])


def test_one_fpo_iteration():
    """objective=fpo: the deterministic sampler collects (its noise drawn per decision); prepare records the old
    surrogate; the first minibatch's ratio is 1; advantages +1 / -1 move the weights; the windows mask the executed
    rows x the env's dims; a config key selects it and FSDP2 is refused."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.config import load_config
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.objectives import FPOObjective
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="fpo", fpo_draws=3, num_groups=1, group_size=2, dynamic_sampling=False,
                       eval_every=0, opt=OptimizerConfig(minibatch_size=64, lr=1e-3, epochs=1))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        assert isinstance(tr.objective, FPOObjective) and not pol.config.model.optimality_condition
        tr.step()
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        assert "model_actions" in a_ep.decisions[0].extras  # the deterministic sampler, not the SDE's chain
        windows = tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0)
        m = windows[0]["action_mask"]
        assert m[: a_ep.decisions[0].num_executed, : pol.action_dim].all() and m.sum() == (
            a_ep.decisions[0].num_executed * pol.action_dim)
        before = [p.detach().clone() for p in pol.model.parameters()]
        upd = tr.optimizer.step(windows)
        assert upd["steps"] == 1 and abs(upd["ratio_mean"] - 1.0) < 1e-4 and upd["clip_frac"] == 0.0
        assert windows[0]["fpo_noise"].shape == (3, 4, 32) and windows[0]["fpo_time"].shape == (3,)
        assert any(not torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))
        # the recorded old surrogate is the behaviour's: re-preparing under the moved weights changes it
        old = [w["logp_old"] for w in windows]
        tr.objective.prepare(windows, torch.Generator().manual_seed(0))
        assert any(abs(a - w["logp_old"]) > 1e-6 for a, w in zip(old, windows))
        fresh = tr.adapter.episode_windows(a_ep, 1.0)
        with pytest.raises(ValueError, match="lack their draws"):
            tr.objective.collate(fresh)
        with pytest.raises(ValueError, match="algo.fsdp=false"):
            RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), RLConfig(objective="fpo", fsdp=True))
    finally:
        runner.close()
    assert load_config("debug_train_pi0", ["algo.objective=fpo", "algo.fpo_draws=2"],
                       check_paths=False).algo.fpo_draws == 2
    with pytest.raises(Exception, match="algo.fpo_draws"):
        load_config("debug_train_pi0", ["algo.objective=fpo", "algo.fpo_draws=0"], check_paths=False)


def test_rft_collects_as_fpo_collects():
    """RFT beside an fpo RL arm rolls out with the same collector: the deterministic sampler (its extras hold the
    sampled chunk, no Flow-SDE chain)."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.collection import rl_collector
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, rft, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    kinds: set = set()

    def callback(st: dict) -> None:
        kinds.update(tuple(sorted(k for k in ("chain", "model_actions") if k in d.extras))
                     for g in st["collection"].groups for ep in g.episodes for d in ep.decisions)

    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        rft(pol, [], runner, InitStateSampler({4: range(4)}), OptimizerConfig(lr=1e-4), seconds=1e-3, num_groups=1,
            group_size=2, steps_per_iteration=1, callback=callback, rl_objective="fpo")
    finally:
        runner.close()
    assert kinds == {("model_actions",)}
    assert type(rl_collector(pol, "ppo", 1.0, 0, torch.Generator())).__name__ == "SDEChunkPolicy"
