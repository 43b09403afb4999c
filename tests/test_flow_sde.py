"""Flow-SDE and the PPO surrogate (issue: RL that beats SFT): pure functions against hand-computed values, and the
recorded log-probability of a sampled chain equal to its recomputation under the unchanged policy."""

from __future__ import annotations

import math

import pytest
import torch

from pi0.models.flow_sde import (DRAWN, EVERY_STEP, chain_coefficients, check_sde, gaussian_log_prob, masked_sum,
                                 pick_sde_step, sampler_step, sde_coefficients, sde_integrate, sde_steps,
                                 sde_step_moments, sde_times)
from pi0.policies.presets import synthetic_observation, tiny_policy
from pi0.ript.objectives import clipped_surrogate


def test_sde_times():
    assert sde_times(4) == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError):
        sde_times(0)


def test_sde_step_moments_by_hand():
    x, v = torch.tensor([1.0]), torch.tensor([2.0])
    # t = 0.5, dt = 0.5, a = 0.5: sigma = 0.5 sqrt(0.5 / 0.5) = 0.5; x1_hat = 1 + 0.5 * 2 = 2;
    # mean = 1 - 0.5 * 2 - (0.25 * 0.5 / 1.0) * 2 = -0.25; std = 0.5 sqrt(0.5)
    mean, std = sde_step_moments(x, v, 0.5, 0.5, 0.5)
    assert torch.allclose(mean, torch.tensor([-0.25])) and math.isclose(float(std), 0.5 * math.sqrt(0.5), rel_tol=1e-6)
    # t = 1 uses 1 - t := dt: dt = 0.25, a = 0.5 -> sigma = 0.5 sqrt(1 / 0.25) = 1; x1_hat = x;
    # mean = x - 0.25 v - (1 * 0.25 / 2) x = 0.875 x - 0.25 v = 0.375; std = 1 * sqrt(0.25) = 0.5
    mean, std = sde_step_moments(x, v, 1.0, 0.25, 0.5)
    assert torch.allclose(mean, torch.tensor([0.375])) and math.isclose(float(std), 0.5, rel_tol=1e-6)
    # the default first step (t = 1, N = 10, a = 1): sigma = sqrt(1 / 0.1); mean = x - 0.1 v - (10 * 0.1 / 2) x
    # = 0.5 x - 0.1 v = 0.3, std = a = 1: half the initial noise is kept, and the step's own noise is std 1
    mean, std = sde_step_moments(x, v, 1.0, 0.1, 1.0)
    assert torch.allclose(mean, torch.tensor([0.3])) and math.isclose(float(std), 1.0, rel_tol=1e-6)
    # a = 0: the deterministic Euler step
    mean, std = sde_step_moments(x, v, 0.3, 0.1, 0.0)
    assert torch.allclose(mean, x - 0.1 * v) and float(std) == 0.0


def test_cps_step_moments_by_hand():
    x, v = torch.tensor([1.0]), torch.tensor([2.0])
    # t = 1, dt = 0.25 (next time s = 0.75), eta = 1: cos = 0, sin = 1. x0_hat = 1 - 2 = -1, x1_hat = 1 + 0 * 2 = 1;
    # mean = (1 - s) x0_hat + s cos x1_hat = -0.25; std = s sin = 0.75 (the step redraws all of x_s's noise)
    mean, std = sde_step_moments(x, v, 1.0, 0.25, 1.0, kind="cps")
    assert torch.allclose(mean, torch.tensor([-0.25])) and math.isclose(float(std), 0.75, rel_tol=1e-6)
    # eta = 0.5: cos = sin = 1/sqrt(2); mean = -0.25 + 0.75 / sqrt(2) = 0.28033, std = 0.75 / sqrt(2)
    mean, std = sde_step_moments(x, v, 1.0, 0.25, 0.5, kind="cps")
    assert torch.allclose(mean, torch.tensor([-0.25 + 0.75 / math.sqrt(2)]))
    assert math.isclose(float(std), 0.75 / math.sqrt(2), rel_tol=1e-6)
    # t = 0.5, dt = 0.25 (s = 0.25), eta = 1: x0_hat = 1 - 0.5 * 2 = 0, so the mean is 0.75 * 0 = 0, std 0.25
    mean, std = sde_step_moments(x, v, 0.5, 0.25, 1.0, kind="cps")
    assert torch.allclose(mean, torch.tensor([0.0]), atol=1e-7) and math.isclose(float(std), 0.25, rel_tol=1e-6)
    # per-sample times (B,): the same values as one call per time
    mean, std = sde_step_moments(torch.ones(2, 1, 1), torch.full((2, 1, 1), 2.0), torch.tensor([1.0, 0.5]), 0.25,
                                 1.0, kind="cps")
    assert torch.allclose(mean.flatten(), torch.tensor([-0.25, 0.0]), atol=1e-7)
    assert torch.allclose(std.flatten(), torch.tensor([0.75, 0.25]))


@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_cps_keeps_the_euler_steps_marginal_where_flow_sde_overshoots(eta):
    """Data a ~ N(0, 0.25), x_1 ~ N(0, 1): the exact velocity at t = 1 is v = E[x1 - a | x_1] = x_1. Both steps
    are linear in x_1 plus independent noise, so Var(x_s) = (d mean / d x_1)^2 + std^2, exactly. The true marginal
    at s = 0.8 is 0.8^2 + 0.2^2 * 0.25 = 0.65 and the Euler step gives 0.8^2 = 0.64; CPS gives 0.64 at every eta,
    Flow-SDE at a = 1 gives 0.3^2 + 1 = 1.09 (its mean x_1 - 0.2 v - x_1 / 2 keeps 0.3 of x_1, its noise has std 1)."""
    one = torch.ones(1)
    for kind, level, want in (("cps", eta, 0.64), ("flow_sde", 1.0, 1.09)):
        slope, std = sde_step_moments(one, one, 1.0, 0.2, level, kind=kind)  # mean at x_1 = 1, v = 1
        assert math.isclose(float(slope) ** 2 + float(std) ** 2, want, rel_tol=1e-5), kind


def test_sde_kind_checks():
    check_sde("cps", 1.0, 3, 5)
    check_sde("flow_sde", 2.0, 4, 5)
    with pytest.raises(ValueError, match="sde kind must be one of"):
        check_sde("ddim", 0.5, 0, 5)
    with pytest.raises(ValueError, match=r"noise level must be in \(0, 1\] for cps"):
        check_sde("cps", 1.5, 0, 5)
    with pytest.raises(ValueError, match="cps cannot make the last denoising step"):
        check_sde("cps", 0.5, 4, 5)
    g = torch.Generator().manual_seed(0)
    assert {pick_sde_step(3, None, g, "cps") for _ in range(50)} == {0, 1}  # never the last step
    assert {pick_sde_step(3, None, g) for _ in range(50)} == {0, 1, 2}
    with pytest.raises(ValueError, match="sde kind must be one of"):
        sde_step_moments(torch.ones(1), torch.ones(1), 1.0, 0.2, 0.5, kind="ddim")


def test_gaussian_log_prob_and_masked_sum_by_hand():
    lp = gaussian_log_prob(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor(1.0))
    assert torch.allclose(lp, torch.tensor([-0.5 - 0.5 * math.log(2 * math.pi), -0.5 * math.log(2 * math.pi)]))
    assert float(gaussian_log_prob(torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.01))) > 0  # a density
    vals = torch.arange(12.0).reshape(1, 3, 4)
    mask = torch.zeros(1, 3, 4, dtype=torch.bool)
    mask[0, :2, :2] = True  # 2 executed steps x 2 env dims: 0 + 1 + 4 + 5
    assert masked_sum(vals, mask).tolist() == [10.0]


def test_clipped_surrogate_by_hand():
    def loss(ratio, adv):
        return clipped_surrogate(torch.tensor([math.log(ratio)]), torch.tensor([0.0]), torch.tensor([adv]))[0].item()

    assert math.isclose(loss(1.5, 1.0), -1.2, rel_tol=1e-6)  # min(1.5, 1.2): clipped
    assert math.isclose(loss(1.5, -1.0), 1.5, rel_tol=1e-6)  # min(-1.5, -1.2): the pessimistic unclipped term
    assert math.isclose(loss(0.5, 1.0), -0.5, rel_tol=1e-6)  # min(0.5, 0.8)
    assert math.isclose(loss(0.5, -1.0), 0.8, rel_tol=1e-6)  # min(-0.5, -0.8): clipped
    _, st = clipped_surrogate(torch.log(torch.tensor([1.5, 1.0])), torch.zeros(2), torch.ones(2))
    assert st["clip_frac"] == 0.5 and math.isclose(st["ratio_mean"], 1.25, rel_tol=1e-6)
    # approx_kl = mean((r - 1) - log r): ((0.5 - log 1.5) + 0) / 2
    assert math.isclose(st["approx_kl"], (0.5 - math.log(1.5)) / 2, rel_tol=1e-6)
    # the gradient flows through the new log-probability only where the ratio is not clipped
    lp = torch.tensor([0.0, math.log(1.5)], requires_grad=True)
    clipped_surrogate(lp, torch.zeros(2), torch.ones(2))[0].backward()
    assert lp.grad.tolist()[1] == 0.0 and lp.grad.tolist()[0] < 0


@pytest.mark.parametrize("pi05,kind", [(False, "flow_sde"), (True, "flow_sde"), (False, "cps")])
def test_recorded_log_prob_equals_recomputation_under_the_same_policy(pi05, kind):
    policy = tiny_policy(seed=1, pi05=pi05)
    inp = policy.prepare_inputs(synthetic_observation(policy, 2))
    args = (inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"], inp["state"])
    noise = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    rec = policy.model.sample_actions_sde(*args, noise=noise, num_steps=5, noise_level=0.5, generator=g,
                                          sde_kind=kind)
    k = rec["sde_step"]
    assert rec["chain"].shape == (2, 6, 50, 32) and torch.equal(rec["chain"][:, -1], rec["actions"])
    again = policy.model.step_log_prob(*args, chain=rec["chain"], sde_step=k, num_steps=5, noise_level=0.5,
                                       sde_kind=kind)
    assert (again - rec["log_prob"]).abs().max() < 1e-3  # cached vs joint prefix path: ~1e-6 in the velocity
    # noise level 0: the deterministic sampler
    det = policy.model.sample_actions_sde(*args, noise=noise, num_steps=5, noise_level=0.0, sde_step=2)
    # (std 0: the step is the Euler step, its log-density is not defined)
    assert torch.allclose(det["actions"], policy.model.sample_actions(*args, noise=noise, num_steps=5), atol=1e-5)


@pytest.mark.parametrize("pi05", [False, True])
def test_one_ppo_iteration_collects_chains_and_updates(pi05):
    """objective=ppo: SDE collection records each decision's chain; the first minibatch's ratio is 1 (the same
    weights), the update moves the parameters; a config key selects it."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.config import load_config
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3,
                                            pi05=pi05), default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", num_groups=1, group_size=2, dynamic_sampling=False, eval_every=0,
                       opt=OptimizerConfig(minibatch_size=64, lr=1e-3, epochs=1))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        assert not pol.config.model.optimality_condition  # LOOP needs no condition
        before = [p.detach().clone() for p in pol.model.parameters()]
        st = tr.step()
        ep = tr.last_collection.groups[0].episodes[0]
        assert ep.decisions[0].extras["chain"].shape == (4, 4, 32) and 0 <= ep.decisions[0].extras["sde_step"] < 3
        assert st["train/steps"] == 1 and abs(st["train/ratio_mean"] - 1.0) < 1e-3 and st["train/clip_frac"] == 0.0
        # the random policy failed both rollouts: A = 0, no gradient, nothing moves (no imitation of own samples)
        assert all(torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))
        # with advantages +1 / -1 the same windows move the weights
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        windows = tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0)
        upd = tr.optimizer.step(windows)
        assert upd["steps"] == 1 and abs(upd["ratio_mean"] - 1.0) < 1e-3
        assert any(not torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))
        # algo.sde_step=k: every decision's stochastic step is k
        from pi0.ript.collection import SDEChunkPolicy
        eps = runner.run([(0, 1)], group_size=2, policy=SDEChunkPolicy(pol, 0.5, torch.Generator().manual_seed(0), 2))
        assert {int(d.extras["sde_step"]) for e in eps for d in e.decisions} == {2}
        # algo.sde_kind=cps reaches the collector and the update's recomputation; not at the last of 3 steps
        cps = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), RLConfig(objective="ppo", sde_kind="cps"))
        assert cps.rollouts.policy.sde_kind == cps.objective.sde_kind == "cps"
        with pytest.raises(ValueError, match="cps cannot make the last denoising step .2."):
            RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), RLConfig(objective="ppo", sde_kind="cps", sde_step=2))
    finally:
        runner.close()
    assert load_config("debug_train_pi0", ["algo.sde_step=0"], check_paths=False).algo.sde_step == 0
    assert load_config("debug_train_pi0", ["algo.sde_step=-2"], check_paths=False).algo.sde_step == EVERY_STEP
    with pytest.raises(Exception, match="algo.sde_step"):
        load_config("debug_train_pi0", ["algo.sde_step=-3"], check_paths=False)
    assert load_config("debug_train_pi0", ["algo.sde_kind=cps", "algo.noise_level=0.5"],
                       check_paths=False).algo.sde_kind == "cps"
    with pytest.raises(Exception, match="algo.sde_kind"):
        load_config("debug_train_pi0", ["algo.sde_kind=ddim"], check_paths=False)
    with pytest.raises(Exception, match=r"noise level must be in \(0, 1\] for cps"):
        load_config("debug_train_pi0", ["algo.sde_kind=cps", "algo.noise_level=1.5"], check_paths=False)
    assert load_config("debug_train_pi0", ["algo.objective=ppo"], check_paths=False).algo.objective == "ppo"
    with pytest.raises(ValueError, match="algo.objective"):
        load_config("debug_train_pi0", ["algo.objective=grpo"], check_paths=False)


def test_trainable_expert_freezes_siglip_and_the_vlm():
    """algo.trainable=expert: an update with non-zero advantages leaves SigLIP and the VLM bit-identical and moves
    the action expert and the projections."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", trainable="expert", num_groups=1, group_size=2, dynamic_sampling=False,
                       eval_every=0, opt=OptimizerConfig(minibatch_size=64, lr=1e-3))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        tr.step()
        before = {k: p.detach().clone() for k, p in pol.model.named_parameters()}
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        tr.optimizer.step(tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0))
    finally:
        runner.close()
    changed = {k for k, p in pol.model.named_parameters() if not torch.equal(before[k], p)}
    assert changed and all(not k.startswith("paligemma_with_expert.paligemma.") for k in changed)
    assert any(k.startswith("paligemma_with_expert.gemma_expert.") for k in changed)
    assert "action_in_proj.weight" in changed


@pytest.mark.parametrize("pi05", [False, True])
def test_value_baseline_recorded_value_head_and_update(pi05, tmp_path):
    """algo.value_baseline: sampling records V per decision and the loss recomputes the same V; the zero-initialised
    head starts at V = 0 (RLOO's advantages); the value loss trains the head at opt.value_lr and leaves the policy's
    weights bit-identical (detached features); the head saves and loads with the policy."""
    from pi0.policies.pi0 import PI0Policy, default_norm_stats
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.update import OptimizerConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3,
                                            pi05=pi05), default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", num_groups=1, group_size=2, dynamic_sampling=False, eval_every=0,
                       value_baseline=True, opt=OptimizerConfig(minibatch_size=64, lr=1e-3, value_lr=1e-2))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        assert pol.config.model.value_head and tr.update.num_value == 6  # fc1, fc2, out: weight + bias
        assert [g["lr"] for g in tr.update.optimizer.param_groups] == [1e-3, 1e-2]
        tr.step()
        eps = tr.last_collection.groups[0].episodes
        assert all(float(d.extras["value"]) == 0.0 for e in eps for d in e.decisions)  # zero-initialised output
        # rewards 1 and 0 (forced): the value loss has a target to move to, the policy gets A = +-1 from RLOO
        wins = tr.adapter.episode_windows(eps[0], 1.0, 1.0) + tr.adapter.episode_windows(eps[1], -1.0, 0.0)
        assert [w["advantage"] for w in wins] == [1.0] * len(eps[0].decisions) + [-1.0] * len(eps[1].decisions)
        heads = {n for n, _ in pol.model.named_parameters() if n.startswith("value_head.")}
        before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
        for w in wins:
            w["advantage"] = 0.0  # no policy gradient: only the value loss acts
        upd = tr.optimizer.step(wins)
        assert upd["value_loss"] > 0
        moved = {n for n, p in pol.model.named_parameters() if not torch.equal(before[n], p)}
        assert moved and moved <= heads  # only the head trained (the policy's weights are bit-identical)
        # the value recorded at sampling equals the one the loss recomputes under the same weights
        from pi0.ript.collection import SDEChunkPolicy
        eps = runner.run([(0, 1)], group_size=2, policy=SDEChunkPolicy(pol, 1.0, torch.Generator().manual_seed(0), 0))
        wins = tr.adapter.episode_windows(eps[0], 0.5, 1.0)
        batch = tr.adapter.collate(wins)
        _, value = pol.model.step_log_prob(batch["images"], batch["img_masks"], batch["lang_tokens"],
                                           batch["lang_masks"], batch["state"], batch["chain"], batch["sde_step"],
                                           pol.config.num_steps, 1.0, return_value=True)
        rec = torch.tensor([float(d.extras["value"]) for d in eps[0].decisions])
        assert rec.abs().max() > 0 and (value.detach() - rec).abs().max() < 1e-4
        # per-decision advantages: RLOO's 0.5 minus the value's change since the first decision
        assert [w["advantage"] for w in wins] == pytest.approx((0.5 - (rec - rec[0])).tolist(), abs=1e-6)
        pol.save_pretrained(tmp_path / "ckpt")
        again = PI0Policy.from_pretrained(tmp_path / "ckpt")
        assert again.config.model.value_head
        assert torch.equal(again.model.value_head.out.weight, pol.model.value_head.out.weight)
    finally:
        runner.close()
    with pytest.raises(ValueError, match="value_baseline"):
        RIPTTrainer(tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2,
                                                      num_steps=3), default_norm_stats(8, 7)),
                    runner, InitStateSampler({0: [0]}), RLConfig(objective="cfg", value_baseline=True))


def test_ppo_collection_through_the_fast_sampler():
    """Flow-SDE collection on FastSampler (PI0Model.sample_actions_sde routes through it): the recorded log-densities
    equal the update's recomputation under the same weights (ratio 1), as with the eager sampler."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    sampler = pol.enable_fast_sampling()
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", num_groups=1, group_size=2, dynamic_sampling=False, eval_every=0,
                       opt=OptimizerConfig(minibatch_size=64, lr=1e-3, epochs=1))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        tr.step()
        assert pol.model.fast_sampler is sampler and sampler._buffers  # the collection ran on the fast path
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        upd = tr.optimizer.step(tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0))
        assert upd["steps"] == 1 and abs(upd["ratio_mean"] - 1.0) < 1e-4 and upd["clip_frac"] == 0.0
    finally:
        runner.close()


def test_sde_integrate_by_hand():
    """v = 1 everywhere, N = 2 (dt 0.5), step 1 stochastic with (1 - t, coef, std) = (0.5, 0.1, 0.2) and eps = 1:
    x1 = 1 - 0.5 = 0.5; mean = 0.5 - 0.5 - 0.1 (0.5 + 0.5) = -0.1; x2 = -0.1 + 0.2 = 0.1."""
    calls: list[int] = []
    draws: list[int] = []

    def velocity(k, x):
        calls.append(k)
        return torch.ones_like(x)

    def eps():
        draws.append(1)
        return torch.ones(1, 1, 1)

    coefs = (torch.tensor(0.5), torch.tensor(0.1), torch.tensor(0.2))
    chain, lp = sde_integrate(velocity, torch.ones(1, 1, 1), 2, 1, coefs, eps)
    torch.testing.assert_close(chain.flatten(), torch.tensor([1.0, 0.5, 0.1]))
    torch.testing.assert_close(lp.flatten(), torch.tensor([-0.5 - math.log(0.2) - 0.5 * math.log(2 * math.pi)]))
    assert calls == [0, 1] and draws == [1]  # one velocity per step, one draw
    # step 0 stochastic instead: mean = 1 - 0.5 - 0.1 (1 + 0.5) = 0.35, x1 = 0.55, then x2 = 0.55 - 0.5
    chain0, _ = sde_integrate(velocity, torch.ones(1, 1, 1), 2, 0, coefs, eps)
    torch.testing.assert_close(chain0.flatten(), torch.tensor([1.0, 0.55, 0.05]))
    n_calls = len(calls)
    with pytest.raises(ValueError, match="sde_step must be in"):
        sde_integrate(velocity, torch.ones(1, 1, 1), 2, 2, coefs, eps)
    assert len(calls) == n_calls  # refused before any velocity is computed


def test_sde_integrate_every_step_by_hand():
    """EVERY_STEP: v = 1, N = 2 (dt 0.5), per-step (1 - t, coef, std) = (0.5, 0.1, 0.2) then (0.5, 0.2, 0.3), eps = 1:
    step 0: mean = 1 - 0.5 - 0.1 (1 + 0.5) = 0.35, x1 = 0.55; step 1: mean = 0.55 - 0.5 - 0.2 (0.55 + 0.5) = -0.16,
    x2 = 0.14; the log-density is the sum of both steps' (each at z = 1)."""
    draws: list[int] = []

    def eps():
        draws.append(1)
        return torch.ones(1, 1, 1)

    coefs = (torch.tensor([0.5, 0.5]).view(2, 1, 1), torch.tensor([0.1, 0.2]).view(2, 1, 1),
             torch.tensor([0.2, 0.3]).view(2, 1, 1))
    chain, lp = sde_integrate(lambda k, x: torch.ones_like(x), torch.ones(1, 1, 1), 2, EVERY_STEP, coefs, eps)
    torch.testing.assert_close(chain.flatten(), torch.tensor([1.0, 0.55, 0.14]))
    c = 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(lp.flatten(), torch.tensor([(-0.5 - math.log(0.2) - c) + (-0.5 - math.log(0.3) - c)]))
    assert draws == [1, 1]  # one draw per stochastic step
    assert list(sde_steps(3, EVERY_STEP)) == [0, 1, 2] and list(sde_steps(3, 1)) == [1]


def test_every_step_settings():
    """sde_step -2 (EVERY_STEP): flow_sde only; the config's -1 is the samplers' None; chain_coefficients stacks each
    step's sde_coefficients."""
    assert sampler_step(DRAWN) is None and sampler_step(EVERY_STEP) == EVERY_STEP and sampler_step(3) == 3
    check_sde("flow_sde", 0.5, EVERY_STEP, 5)
    assert pick_sde_step(5, EVERY_STEP) == EVERY_STEP
    with pytest.raises(ValueError, match="cps cannot make every step stochastic"):
        check_sde("cps", 0.5, EVERY_STEP, 5)
    with pytest.raises(ValueError, match="cps cannot make every step stochastic"):
        pick_sde_step(5, EVERY_STEP, kind="cps")
    like = torch.zeros(1)
    every = chain_coefficients(4, EVERY_STEP, 0.7, like)
    for k, t in enumerate(sde_times(4)):
        one = chain_coefficients(4, k, 0.7, like)
        for a, b, c in zip(every, one, sde_coefficients(t, 0.25, 0.7, like)):
            torch.testing.assert_close(b, c)
            torch.testing.assert_close(a[k].reshape(()), b)


def test_whole_chain_ppo_iteration():
    """algo.sde_step=-2: every decision records the whole chain's log-density, the update recomputes it (ratio 1
    before any step), and the trainer refuses cps with every step stochastic."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", num_groups=1, group_size=2, dynamic_sampling=False, eval_every=0,
                       sde_step=EVERY_STEP, noise_level=0.5, opt=OptimizerConfig(minibatch_size=64, lr=1e-3, epochs=1))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        tr.step()
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        assert {int(d.extras["sde_step"]) for e in (a_ep, b_ep) for d in e.decisions} == {EVERY_STEP}
        before = [p.detach().clone() for p in pol.model.parameters()]
        upd = tr.optimizer.step(tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0))
        assert upd["steps"] == 1 and abs(upd["ratio_mean"] - 1.0) < 1e-3 and upd["clip_frac"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))
        with pytest.raises(ValueError, match="cps cannot make every step stochastic"):
            RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), RLConfig(objective="ppo", sde_kind="cps",
                                                                          noise_level=0.5, sde_step=EVERY_STEP))
    finally:
        runner.close()
