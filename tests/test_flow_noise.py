"""Flow-Noise (``algo.noise=learned``, issue 39 item 7): the bounded std against hand-computed values, the sampler's
chain and log-density against a step-by-step recomputation, the update's batched recomputation equal to the
recording (ratio 1), PPO training the head, and the head's checkpoint and config round trips."""

from __future__ import annotations

import math

import pytest
import torch

from pi0.models.flow_noise import NoiseHead, noise_head_std
from pi0.models.flow_sde import gaussian_log_prob, sde_times
from pi0.policies.presets import synthetic_observation, tiny_policy


def test_noise_head_std_by_hand():
    raw = torch.tensor([0.0, 50.0, -50.0, math.atanh(0.5)])
    std = noise_head_std(raw, 0.08, 0.16)
    # tanh 0 -> the middle of [log 0.08^2, log 0.16^2] -> std = sqrt(0.08 * 0.16); +-inf -> the bounds
    # tanh = 0.5 -> logvar = lo + 0.75 (hi - lo) -> std = 0.08^(1/4) 0.16^(3/4)
    want = [math.sqrt(0.08 * 0.16), 0.16, 0.08, 0.08 ** 0.25 * 0.16 ** 0.75]
    assert std.tolist() == pytest.approx(want, rel=1e-5)
    assert noise_head_std(torch.tensor([3.0]), 0.1, 0.1).tolist() == pytest.approx([0.1], rel=1e-6)  # a fixed std


def test_noise_head_starts_at_the_geometric_mean_and_shapes():
    head = NoiseHead(16, 7)
    raw = head(torch.randn(2, 5, 16))
    assert raw.shape == (2, 5, 7) and torch.equal(raw, torch.zeros(2, 5, 7))  # zero output layer


def _inputs(policy, b: int = 2):
    inp = policy.prepare_inputs(synthetic_observation(policy, b))
    return (inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"], inp["state"])


@pytest.mark.parametrize("pi05", [False, True])
def test_chain_and_log_density_by_hand_and_recomputed(pi05):
    """Every step of the recorded chain is x_k - dt v(x_k, t_k) plus noise of the head's std; the recorded log-density
    is the N transitions' sum / (N + 1); ``chain_log_prob`` (one batched suffix pass) gives it back."""
    policy = tiny_policy(seed=1, pi05=pi05)
    model = policy.model.enable_noise_head((0.05, 0.2))
    with torch.no_grad():  # a head that is not at its zero start: stds differ per token and dim
        for p in model.noise_head.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
    args = _inputs(policy)
    noise = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(0))
    n = 3
    rec = model.sample_actions_flow_noise(*args, noise=noise, num_steps=n, generator=torch.Generator().manual_seed(3))
    chain = rec["chain"]
    assert chain.shape == (2, n + 1, 50, 32) and torch.equal(chain[:, 0], noise) and torch.equal(chain[:, -1],
                                                                                                 rec["actions"])
    cache, pad = model.encode_prefix(*args[:4])
    total, stds = torch.zeros(2, 50, 32), []
    with torch.no_grad():
        for k, t in enumerate(sde_times(n)):
            v, s_out = model.denoise_step(cache, pad, args[4], chain[:, k], torch.full((2,), t), return_suffix=True)
            std = model.noise_std(s_out, 50)
            stds.append(std)
            assert std.min() >= 0.05 - 1e-6 and std.max() <= 0.2 + 1e-6
            total += gaussian_log_prob(chain[:, k + 1], chain[:, k] - v / n, std)
    assert float(torch.cat(stds).std()) > 1e-3  # the head's std varies with the token and dim
    assert (rec["log_prob"] - total / (n + 1)).abs().max() < 1e-4
    again = model.chain_log_prob(*args, chain=chain)
    assert again.shape == (2, 50, 32) and (again - rec["log_prob"]).abs().max() < 1e-3


def test_flow_noise_needs_the_head():
    policy = tiny_policy(seed=0)
    with pytest.raises(ValueError, match="enable_noise_head"):
        policy.model.sample_actions_flow_noise(*_inputs(policy), noise=torch.zeros(2, 50, 32), num_steps=2)
    from pi0.models.config import Pi0Config
    with pytest.raises(ValueError, match="noise_std"):
        Pi0Config.tiny(noise_std=(0.2, 0.1))


def test_ppo_with_learned_noise_trains_the_head_and_round_trips(tmp_path):
    """algo.noise=learned: collection records every step's chain (sde_step -1) and the log-density the update
    recomputes (ratio 1); advantages +-1 move the noise head and the expert; the head saves and loads; bad settings
    are one-line errors."""
    from pi0.policies.pi0 import PI0Policy, default_norm_stats
    from pi0.ript.config import load_config
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.trainer import RIPTTrainer, RLConfig
    from pi0.ript.update import OptimizerConfig
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="ppo", noise="learned", noise_min_std=0.1, noise_max_std=0.3, num_groups=1,
                       group_size=2, dynamic_sampling=False, eval_every=0,
                       opt=OptimizerConfig(minibatch_size=64, lr=1e-2))
        tr = RIPTTrainer(pol, runner, InitStateSampler({0: [0]}), cfg)
        assert pol.config.model.noise_head and pol.config.model.noise_std == (0.1, 0.3)
        heads = {n for n, p in pol.model.named_parameters() if n.startswith("noise_head.") and p.requires_grad}
        assert len(heads) == 6
        tr.step()
        a_ep, b_ep = tr.last_collection.groups[0].episodes
        d = a_ep.decisions[0].extras
        assert d["chain"].shape == (4, 4, 32) and int(d["sde_step"]) == -1
        # the chunk executed is the chain's end, and its spread is the head's: std sqrt(0.1 * 0.3) at the start
        before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
        windows = tr.adapter.episode_windows(a_ep, 1.0) + tr.adapter.episode_windows(b_ep, -1.0)
        upd = tr.optimizer.step(windows)
        assert upd["steps"] == 1 and abs(upd["ratio_mean"] - 1.0) < 1e-3 and upd["approx_kl"] < 1e-6
        moved = {n for n, p in pol.model.named_parameters() if not torch.equal(before[n], p)}
        assert "noise_head.out.weight" in moved and "action_out_proj.weight" in moved
        pol.save_pretrained(tmp_path / "ckpt")
        again = PI0Policy.from_pretrained(tmp_path / "ckpt")
        assert again.config.model.noise_head and again.config.model.noise_std == (0.1, 0.3)
        assert torch.equal(again.model.noise_head.out.weight, pol.model.noise_head.out.weight)
    finally:
        runner.close()
    assert load_config("debug_train_pi0", ["algo.noise=learned"], check_paths=False).algo.noise == "learned"
    for bad, key in ((["algo.noise=gauss"], "algo.noise"), (["algo.noise_max_std=0.01"], "algo.noise_min_std"),
                     (["algo.noise=learned", "algo.objective=cfg"], "algo.noise=learned")):
        with pytest.raises(Exception, match=key):
            load_config("debug_train_pi0", bad, check_paths=False)
