"""RIPT core: RLOO, labels, guidance, windows and the action convention, bounded collection, the CFG objective,
updates, the converged warm start and RFT (hand-checked)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pi0.errors import UserError
from pi0.models.flow import cfg_combine
from pi0.modeling_pi0 import PI0Policy
from pi0.rollout import ArenaExpertPolicy, DecisionPoint, Episode
from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import (PI0_CFG_Adapter, cfg_condition_inputs,
                                                            env_to_model_actions, masked_flow_loss)
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig, RLOptimizerPI0_CFG
from pi0.ript.collection import RolloutGenerator
from pi0.ript.objectives import CFGObjective, FlowMatchingObjective, action_target
from pi0.ript.algos.rloo import (episode_mean_advantages, informative_groups, optimality_labels, rloo_advantages,
                                 value_baselined_advantages)
from pi0.ript.init_states import InitStateHistory, InitStateSampler, split_states
from pi0.ript.reward_function import BinarySuccessReward
from pi0.ript.trainer import RIPTTrainer, RLConfig, enable_optimality_condition
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy
from pi0.modeling_pi0 import default_norm_stats


# ----------------------------------------------------------------------------- pure functions
def test_rloo_k8_two_successes():
    r = np.array([[1, 1, 0, 0, 0, 0, 0, 0]], float)
    a = rloo_advantages(r)
    # success: 1 - 1/7 = 0.857..., failure: 0 - 2/7 = -0.2857...
    np.testing.assert_allclose(a[0, :2], 6 / 7)
    np.testing.assert_allclose(a[0, 2:], -2 / 7)
    assert round(float(a[0, 0]), 3) == 0.857 and round(float(a[0, 2]), 3) == -0.286


def test_rloo_hand_values_and_bad_shape():
    a = rloo_advantages(np.array([[1.0, 0.0, 0.5]]))
    np.testing.assert_allclose(a, [[1 - 0.25, 0 - 0.75, 0.5 - 0.5]])
    with pytest.raises(ValueError, match="K >= 2"):
        rloo_advantages(np.array([[1.0]]))


def test_value_baselined_advantages_by_hand():
    # a success (RLOO A = 6/7) whose value rose 0.2 -> 0.5 -> 0.9: later decisions get less credit,
    # A_t = 6/7 - (V_t - 0.2) = 6/7, 6/7 - 0.3, 6/7 - 0.7
    np.testing.assert_allclose(value_baselined_advantages(6 / 7, np.array([0.2, 0.5, 0.9])),
                               [6 / 7, 6 / 7 - 0.3, 6 / 7 - 0.7])
    # a failure (A = -2/7) after the value fell 0.6 -> 0.1: the decision that lost the odds keeps the blame,
    # the one taken from the lost state is blamed less: -2/7, -2/7 + 0.5
    np.testing.assert_allclose(value_baselined_advantages(-2 / 7, np.array([0.6, 0.1])), [-2 / 7, -2 / 7 + 0.5])
    # a constant value (the head at its zero init) gives RLOO's advantage to every decision
    assert value_baselined_advantages(0.25, np.zeros(4)).tolist() == [0.25] * 4
    with pytest.raises(ValueError, match="T >= 1"):
        value_baselined_advantages(1.0, np.zeros(0))


def test_episode_mean_advantages_by_hand():
    # K = 2: a success of 10 windows (A = +1) and a failure of 30 (A = -1); per window the sum is 10 - 30 = -20, a net
    # push down; mean length 20: 1 x 20 / 10 = 2 and -1 x 20 / 30 = -2/3, and 10 x 2 + 30 x (-2/3) = 0
    a = episode_mean_advantages(np.array([1.0, -1.0]), np.array([10, 30]))
    np.testing.assert_allclose(a, [2.0, -2 / 3])
    assert abs((a * np.array([10, 30])).sum()) < 1e-12
    # equal lengths change nothing
    np.testing.assert_allclose(episode_mean_advantages(np.array([0.5, -0.5]), np.array([7, 7])), [0.5, -0.5])
    with pytest.raises(ValueError, match="at least one window"):
        episode_mean_advantages(np.array([1.0]), np.array([0]))
    with pytest.raises(ValueError, match="alike"):
        episode_mean_advantages(np.array([1.0, 0.0]), np.array([3]))


def test_labels_all_equal_group_has_no_positives():
    r = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], float)
    labels = optimality_labels(rloo_advantages(r))
    assert not labels[0].any() and not labels[1].any()
    assert labels[2].tolist() == [True, False, False, False]
    assert informative_groups(r).tolist() == [False, False, True]


def test_guidance_formula():
    vu, vc = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.0])
    assert torch.equal(cfg_combine(vu, vc, 0.0), vu)
    assert torch.equal(cfg_combine(vu, vc, 1.0), vc)
    assert torch.allclose(cfg_combine(vu, vc, 2.0), torch.tensor([5.0, 2.0]))  # vu + 2 (vc - vu)
    assert torch.allclose(cfg_combine(vu, vc, 1.5), torch.tensor([4.0, 1.0]))


def test_masked_flow_loss_and_condition_dropout():
    sq = torch.tensor([[[1.0, 3.0], [5.0, 7.0]]])
    mask = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    assert torch.allclose(masked_flow_loss(sq, mask), torch.tensor([3.0]))  # (1 + 5) / 2
    labels = torch.tensor([1.0, 0.0, 1.0])
    assert cfg_condition_inputs(labels, 0.0).tolist() == [1.0, 0.0, 1.0]
    assert cfg_condition_inputs(labels, 1.0).tolist() == [0.0, 0.0, 0.0]


def test_reward_and_sampler_flatten_uneven_tasks(tmp_path):
    s = InitStateSampler({0: [0, 1, 2], 3: [7]}, seed=0)
    assert len(s) == 4 and sorted(s.sample(4)) == [(0, 0), (0, 1), (0, 2), (3, 7)]
    with pytest.raises(ValueError, match="no init states"):
        InitStateSampler({0: []})
    h = InitStateHistory(reprobe_after=2)
    h.update((0, 1), [1, 1])
    h.update((0, 2), [1, 0])
    assert [h.should_skip((0, 1)) for _ in range(3)] == [True, True, False]  # re-probed after 2 skips
    assert not h.should_skip((0, 2)) and not h.should_skip((5, 5))
    h2 = InitStateHistory.load(h.save(tmp_path / "hist.json"))
    assert h2.last == h.last and h2.reprobe_after == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        InitStateHistory.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="not an init-state history"):
        InitStateHistory.load(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- model: condition + guidance
@pytest.fixture(scope="module")
def arena_policy() -> PI0Policy:
    torch.manual_seed(0)
    return tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2),
                             default_norm_stats(8, 7))


def _inputs(policy: PI0Policy, b: int = 2):
    g = torch.Generator().manual_seed(1)
    size = policy.config.model.vision.image_size
    obs = {"image": {k: torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)
                     for k in policy.config.image_keys},
           "state": torch.randn(b, 8, generator=g), "prompt": ["push the red block onto the blue target"] * b}
    return policy.prepare_inputs(obs)


def test_zero_init_condition_leaves_outputs_unchanged(arena_policy):
    pol = PI0Policy(arena_policy.config, arena_policy.norm_stats, arena_policy.tokenizer,
                    tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2,
                                                      num_steps=2), default_norm_stats(8, 7)).model)
    inp = _inputs(pol)
    args = (inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"], inp["state"])
    noise = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2))
    before = pol.model.sample_actions(*args, noise, 2)
    enable_optimality_condition(pol, guidance=2.0)
    assert pol.config.model.optimality_condition and torch.count_nonzero(pol.model.optimality_embedding) == 0
    for w in (0.0, 1.0):  # one pass of B: bit-identical
        assert torch.equal(pol.model.sample_actions(*args, noise, 2, guidance=w), before)
    # w=2: both branches in one batch of 2B (batched matmuls may round differently in the last bits)
    torch.testing.assert_close(pol.model.sample_actions(*args, noise, 2, guidance=2.0), before, atol=1e-5, rtol=1e-5)


def test_guided_sampling_is_one_batched_pass_matching_separate_branches(arena_policy, tmp_path):
    pol = arena_policy
    enable_optimality_condition(pol)
    with torch.no_grad():
        pol.model.optimality_embedding.copy_(torch.linspace(-1, 1, pol.model.optimality_embedding.numel()))
    inp = _inputs(pol)
    m = pol.model
    cache, pad = m.encode_prefix(inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"])
    x, t = torch.randn(2, 4, 32), torch.full((2,), 0.7)
    vu = m.denoise_step(cache, pad, inp["state"], x, t, torch.zeros(2))
    vc = m.denoise_step(cache, pad, inp["state"], x, t, torch.ones(2))
    assert not torch.allclose(vu, vc)
    calls = []
    orig = m.denoise_step
    m.denoise_step = lambda *a, **k: calls.append(a[3].shape[0]) or orig(*a, **k)  # count passes
    try:
        v2 = m.guided_velocity_fn(cache, pad, inp["state"], 2.0)(x, t)
        v0 = m.guided_velocity_fn(cache, pad, inp["state"], 0.0)(x, t)
        v1 = m.guided_velocity_fn(cache, pad, inp["state"], 1.0)(x, t)
    finally:
        del m.denoise_step
    assert calls == [4, 2, 2]  # w=2: both branches in one batch of 2B; w=0 / w=1: one pass of B
    torch.testing.assert_close(v2, vu + 2.0 * (vc - vu), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v0, vu), torch.testing.assert_close(v1, vc)
    # saved with the checkpoint: config field + parameter, reloaded strictly
    pol.config.cfg_guidance = 1.5
    loaded = PI0Policy.from_pretrained(pol.save_pretrained(tmp_path / "ckpt"))
    assert loaded.config.model.optimality_condition and loaded.config.cfg_guidance == 1.5
    torch.testing.assert_close(loaded.model.optimality_embedding, m.optimality_embedding)


# ----------------------------------------------------------------------------- windows
def _episode(n_dec: int = 2, valid_last: int = 1) -> Episode:
    decs = []
    for i in range(n_dec):
        valid = np.array([True, True] if i < n_dec - 1 else [True] * valid_last + [False] * (2 - valid_last))
        img = np.full((28, 28, 3), 10 * i, np.uint8)
        ex = {"image": img, "wrist_image": img + 1, "state": np.full(32, float(i), np.float32),
              "model_actions": np.full((4, 32), 100.0 + i, np.float32), "noise": np.zeros((4, 32), np.float32),
              "tokenized_prompt": np.arange(24), "tokenized_prompt_mask": np.ones(24, bool)}
        acts = np.where(valid[:, None], np.arange(1, 8, dtype=float)[None] * (i + 1), 0.0)
        decs.append(DecisionPoint(step=2 * i, obs={}, actions=acts, valid=valid, rewards=np.zeros(2), extras=ex))
    return Episode(0, 0, 0, 0, 0, "p", True, 3, 1.0, True, False, decs)


def test_windows_use_each_decision_points_own_observation(arena_policy):
    ad = PI0_CFG_Adapter(arena_policy)
    ws = ad.episode_windows(_episode(3), advantage=0.5)
    assert [int(w["image"][0, 0, 0]) for w in ws] == [0, 10, 20]
    assert [float(w["state"][0]) for w in ws] == [0.0, 1.0, 2.0]
    assert [float(w["actions"][0, 0]) for w in ws] == [100.0, 101.0, 102.0]
    # openpi's convention: every row, ALL 32 dims in the loss; the padded dims' target is 0, not the sampled value
    assert ws[0]["action_mask"].sum(0).tolist() == [4.0] * 32
    assert np.all(ws[0]["actions"][:, 7:] == 0) and np.all(ws[0]["actions"][:, :7] == 100.0)
    assert all(w["label"] == 1.0 for w in ws) and ad.episode_windows(_episode(), 0.0)[0]["label"] == 0.0
    assert ws[1]["advantage"] == 0.5


def test_action_target_zero_pads_and_masks_all_dims():
    chunk = np.arange(12, dtype=np.float32).reshape(3, 4)  # H=3 rows, A=4 model dims, 2 env dims
    tgt, mask = action_target(chunk, 2, np.array([True, True, False]))
    np.testing.assert_array_equal(tgt, [[0, 1, 0, 0], [4, 5, 0, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert action_target(chunk, 4)[1].sum() == 12  # no row mask: every row


def test_demo_windows_train_every_dim_of_the_valid_rows(arena_policy):
    from pi0.envs.arena import ArenaExpert, ArenaState
    from pi0.ript.warm_start import arena_expert_demos, demo_windows

    demos = arena_expert_demos([(4, 0)], horizon=4, replan_steps=2, resolution=28)
    ws = demo_windows(arena_policy, demos)
    ep, chunks = demos[0]
    assert len(ws) == len(ep.decisions) == len(chunks)
    assert ws[0]["action_mask"].sum() == 4 * 32 and ws[0]["label"] == 0.0 and ws[0]["success"] == 1.0
    assert np.all(ws[0]["actions"][:, 7:] == 0)
    np.testing.assert_allclose(ws[0]["actions"][:, :7],
                               env_to_model_actions(arena_policy, chunks[0], ws[0]["state"])[:, :7], rtol=1e-6)
    ref = ArenaExpert().predict_chunk(ArenaState.from_vector(ep.decisions[0].obs["arena_state"]), 4)
    np.testing.assert_allclose(chunks[0], ref)
    np.testing.assert_allclose(env_to_model_actions(arena_policy, np.ones((1, 7)), np.zeros(32))[0, :8],
                               [1, 1, 1, 1, 1, 1, 1, 0], rtol=1e-5)  # identity stats (+eps), no deltas, 0-padded


# ----------------------------------------------------------------------------- updates
def test_nan_loss_is_skipped_and_reported(arena_policy):
    ad = PI0_CFG_Adapter(arena_policy)
    ws = ad.episode_windows(_episode(2), advantage=1.0)
    for w in ws:
        w["actions"] = np.full_like(w["actions"], np.nan)
    opt = RLOptimizerPI0_CFG(ad, OptimizerConfig(minibatch_size=2))
    before = [p.detach().clone() for p in arena_policy.model.parameters()]
    st = opt.step(ws)
    assert st["skipped_steps"] == 1 and st["steps"] == 0 and opt.num_skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, arena_policy.model.parameters()))


def test_positive_windows_train_the_condition(arena_policy):
    enable_optimality_condition(arena_policy)
    ad = PI0_CFG_Adapter(arena_policy, p_uncond=0.0)
    emb = arena_policy.model.optimality_embedding.detach().clone()
    opt = RLOptimizerPI0_CFG(ad, OptimizerConfig(minibatch_size=4, lr=1e-2))
    st = opt.step(ad.episode_windows(_episode(2), advantage=1.0))
    assert st["steps"] == 1 and st["frac_cond"] == 1.0 and "loss_cond" in st
    assert not torch.equal(arena_policy.model.optimality_embedding, emb)


def test_cfg_negatives_train_the_reference_at_full_weight(arena_policy):
    """CFGRL: a window with A <= 0 trains the unconditioned branch with the plain flow loss (weight 1), so the
    reference models all the behaviour data, failures included; positives at p_uncond=1 do the same."""
    enable_optimality_condition(arena_policy)
    ad = CFGObjective(arena_policy, p_uncond=0.0)
    neg = ad.collate(ad.episode_windows(_episode(2), advantage=-0.5))
    pos_dropped = CFGObjective(arena_policy, p_uncond=1.0)
    pos = ad.collate(ad.episode_windows(_episode(2), advantage=0.5))
    plain = FlowMatchingObjective(arena_policy)
    g = torch.Generator().manual_seed(0)
    torch.rand(len(neg["label"]), generator=g)  # the condition-dropout draw the CFG loss makes first
    ref, _ = plain.loss(neg, g)
    got, st = ad.loss(neg, torch.Generator().manual_seed(0))
    assert st["frac_cond"] == 0.0 and float(got.detach()) > 0
    torch.testing.assert_close(got, ref)
    _, st_pos = pos_dropped.loss(pos, torch.Generator().manual_seed(0))
    assert st_pos["frac_cond"] == 0.0 and "loss_uncond" in st_pos
    _, st_c = ad.loss(pos, torch.Generator().manual_seed(0))
    assert st_c["frac_cond"] == 1.0 and "loss_cond" in st_c


def test_split_states_train_and_held_out_are_disjoint():
    train, held = split_states([4, 1], 3, 5, 2)
    assert train == {4: range(3), 1: range(3)} and held == [(4, 5), (4, 6), (1, 5), (1, 6)]
    assert split_states([0], 5, 3, 0)[1] == []  # no held-out states: nothing to overlap
    with pytest.raises(ValueError, match="overlap"):
        split_states([0], 5, 3, 2)


def test_bounded_collection_when_everything_succeeds():
    runner = arena_runner(4, replan_steps=10, resolution=32)
    try:
        gen = RolloutGenerator(runner, ArenaExpertPolicy(horizon=10), InitStateSampler({4: [0, 1]}), group_size=2,
                               max_attempts=2)
        col = gen.collect(2)
        assert col.groups == [] and col.attempts == 2 and col.num_groups == 4 and col.success_rate == 1.0
        assert "stopped after 2 collection rounds" in col.exhausted
        hist = InitStateHistory(reprobe_after=3)
        gen = RolloutGenerator(runner, ArenaExpertPolicy(horizon=10), InitStateSampler({4: [0, 1]}), group_size=2,
                               history=hist, max_attempts=10)
        col = gen.collect(2)
        assert "every init state is solved" in col.exhausted and col.attempts == 2
        assert BinarySuccessReward().group_rewards(col.groups[0].episodes if col.groups else [], 2).size == 0
    finally:
        runner.close()


def test_one_rl_iteration_changes_parameters(arena_policy):
    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        cfg = RLConfig(objective="cfg", num_groups=1, group_size=2, dynamic_sampling=False, eval_every=1,
                       opt=OptimizerConfig(minibatch_size=8, lr=1e-3))
        tr = RIPTTrainer(arena_policy, runner, InitStateSampler({0: [0]}), cfg, eval_states=[(0, 1)])
        before = [p.detach().clone() for p in arena_policy.model.parameters()]
        st = tr.step()
        assert st["train/windows"] == 6 and st["train/steps"] == 1 and "eval/success_rate" in st
        assert any(not torch.equal(a, b) for a, b in zip(before, arena_policy.model.parameters()))
    finally:
        runner.close()


def test_noisy_demos_execute_noise_but_keep_clean_expert_labels():
    from pi0.envs.arena import ArenaExpert, ArenaState
    from pi0.ript.warm_start import collect_expert_demos

    runner = arena_runner(2, replan_steps=5, resolution=32)
    try:
        clean = collect_expert_demos(runner, [(4, 0)], horizon=10)
        noisy = collect_expert_demos(runner, [(4, 0)], horizon=10, noise=0.3, seed=1)
    finally:
        runner.close()
    (ec, cc), (en, cn) = clean[0], noisy[0]
    # noise-free: the executed actions are the label chunk's first steps
    np.testing.assert_allclose(ec.decisions[0].actions, cc[0][: len(ec.decisions[0].actions)])
    # noisy: executed actions differ from the labels, and each label is the clean expert's chunk at that state
    d = en.decisions[1]
    assert np.abs(d.actions[:, :3] - cn[1][: len(d.actions), :3]).max() > 0.05
    ref = ArenaExpert().predict_chunk(ArenaState.from_vector(d.obs["arena_state"]), 10)
    np.testing.assert_allclose(cn[1], ref)
    assert cn[1].min() >= -1 and cn[1].max() <= 1


def test_scratch_init_norms_identity_and_lecun_weights():
    from torch import nn

    from pi0.models.gemma import RMSNorm
    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2,
                                            init="scratch"), default_norm_stats(8, 7))
    m = pol.model
    for mod in m.modules():
        if isinstance(mod, RMSNorm):  # scale 1 + w
            assert torch.count_nonzero(mod.weight) == 0
        elif isinstance(mod, nn.LayerNorm):
            assert torch.equal(mod.weight, torch.ones_like(mod.weight)) and torch.count_nonzero(mod.bias) == 0
    conv = m.paligemma_with_expert.paligemma.vision_tower.vision_model.embeddings.patch_embedding
    assert abs(float(conv.weight.detach().std()) * (3 * 14 * 14) ** 0.5 - 1.0) < 0.05  # std = fan_in ** -0.5
    assert torch.count_nonzero(conv.bias) == 0
    enable_optimality_condition(pol)
    assert torch.count_nonzero(m.optimality_embedding) == 0
    with pytest.raises(ValueError, match="init must be"):
        PI0Policy.random_init(pol.config, pol.norm_stats, pol.tokenizer, init="xavier")


def test_sft_to_plateau_stops_after_patience_and_keeps_the_best_weights(tmp_path):
    from pi0.ript.warm_start import Plateau, cached_warm_start, sft_to_plateau
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    pol = tiny_arena_policy(cfg, default_norm_stats(8, 7))
    from pi0.ript.warm_start import arena_expert_demos, demo_windows
    windows = demo_windows(pol, arena_expert_demos([(4, 0)], 4, 2, resolution=32))
    runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=4)
    snaps = []
    orig = pol.model.state_dict
    try:
        import pi0.ript.warm_start as ws

        real_eval = ws.evaluate
        vals = iter([0.2, 0.5, 0.4, 0.5, 0.1, 0.9])  # best 0.5 at check 2; checks 3-5 do not beat it (patience 3)

        def fake_eval(*a, **k):  # the scripted validation curve; the weights at each check are recorded
            snaps.append({k: v.clone() for k, v in orig().items()})
            return next(vals)
        ws.evaluate = fake_eval
        curve = sft_to_plateau(pol, windows, OptimizerConfig(lr=1e-2, minibatch_size=8), 100,
                               Plateau([(4, 9)], every=2, patience=3), runner, log=False)
    finally:
        ws.evaluate = real_eval
        runner.close()
    assert [c["steps"] for c in curve] == [2, 4, 6, 8, 10] and [c["val_success"] for c in curve][:2] == [0.2, 0.5]
    for k, v in pol.model.state_dict().items():  # the best check's weights (the 2nd), not the last
        assert torch.equal(v, snaps[1][k]), k
    assert any(not torch.equal(snaps[1][k], snaps[-1][k]) for k in snaps[1])
    # cached by config hash: the record holds the curve, the steps of the best check and the plateau
    stop = Plateau([(4, 7)], every=2, patience=1)
    pol2, windows2, root = cached_warm_start(cfg, [(4, 0)], 10, OptimizerConfig(lr=1e-3, minibatch_size=8),
                                             cache_dir=tmp_path, resolution=32, stop=stop)
    rec = json.loads((root / "warm_start.json").read_text())
    assert [c["steps"] for c in rec["curve"]] == [2, 4] and rec["steps"] == 2 and rec["plateau"] == 0.0
    assert (root / "model.safetensors").is_file() and root.parent == tmp_path / "ript_warm_start" and windows2


def test_smoothed_plateau_ignores_a_lucky_check_and_a_capped_start_is_an_error():
    import pi0.ript.warm_start as ws
    from pi0.ript.warm_start import Plateau, arena_expert_demos, demo_windows, sft_to_plateau
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    pol = tiny_arena_policy(cfg, default_norm_stats(8, 7))
    windows = demo_windows(pol, arena_expert_demos([(4, 0)], 4, 2, resolution=32))
    runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=4)
    real_eval, snaps = ws.evaluate, []
    try:
        def scripted(values):
            it = iter(values)

            def fake_eval(*a, **k):  # the scripted validation curve; the weights at each check are recorded
                snaps.append({n: v.clone() for n, v in pol.model.state_dict().items()})
                return next(it)
            return fake_eval
        # a lucky 0.9 at check 2; the mean of the last 3 checks (from check 3 on) peaks at check 6 (0.5, 0.6, 0.6)
        ws.evaluate = scripted([0.2, 0.9, 0.1, 0.5, 0.6, 0.6, 0.2, 0.1, 0.1])
        curve = sft_to_plateau(pol, windows, OptimizerConfig(lr=1e-2, minibatch_size=8), 100,
                               Plateau([(4, 9)], every=2, patience=2, smooth=3), runner, log=False)
        np.testing.assert_allclose([np.nan if c["val_smoothed"] is None else c["val_smoothed"] for c in curve],
                                   [np.nan, np.nan, 0.4, 0.5, 0.4, 1.7 / 3, 1.4 / 3, 0.3], atol=1e-12)
        for n, v in pol.model.state_dict().items():  # check 6's weights
            assert torch.equal(v, snaps[5][n]), n
        # still improving when the cap comes: not converged by its own rule
        ws.evaluate = scripted([0.1, 0.2, 0.3])
        with pytest.raises(UserError, match="did not converge"):
            sft_to_plateau(pol, windows, OptimizerConfig(lr=1e-2, minibatch_size=8), 6,
                           Plateau([(4, 9)], every=2, patience=2, require_convergence=True), runner, log=False)
    finally:
        ws.evaluate = real_eval
        runner.close()
    # the new fields name a cached start only when set: the starts cached before them keep their keys
    assert "smooth" not in Plateau([(4, 9)]).key_fields() and Plateau([(4, 9)], smooth=3).key_fields()["smooth"] == 3


def test_patience_counts_only_once_the_start_has_succeeded(tmp_path):
    """patience_from_success: checks at 0 before the first success are not a plateau (seed 2 of arena task 2 stopped
    there, 2,750 steps in, with a plateau of 0); a start that never succeeds is an error, not converged; a cached
    start with a plateau of 0 is retrained under the rule and a positive one reused."""
    import pi0.ript.warm_start as ws
    from pi0.ript.warm_start import Plateau, arena_expert_demos, cached_warm_start, demo_windows, sft_to_plateau
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    pol = tiny_arena_policy(cfg, default_norm_stats(8, 7))
    windows = demo_windows(pol, arena_expert_demos([(4, 0)], 4, 2, resolution=32))
    runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=4)
    real_eval, opt = ws.evaluate, OptimizerConfig(lr=1e-2, minibatch_size=8)
    values = [0.0, 0.0, 0.0, 0.0, 0.1, 0.3, 0.2, 0.2, 0.9]
    try:
        curves = {}
        for rule in (False, True):
            it = iter(values)
            ws.evaluate = lambda *a, **k: next(it)
            curves[rule] = sft_to_plateau(pol, windows, opt, 100, Plateau([(4, 9)], every=2, patience=2,
                                                                          patience_from_success=rule), runner,
                                          log=False)
        it = iter([0.0] * 3)
        ws.evaluate = lambda *a, **k: next(it)
        with pytest.raises(UserError, match="never succeeded on its 1 validation states in 6 steps"):
            sft_to_plateau(pol, windows, opt, 6, Plateau([(4, 9)], every=2, patience=2, require_convergence=True,
                                                         patience_from_success=True), runner, log=False)
    finally:
        ws.evaluate = real_eval
        runner.close()
    assert [c["val_success"] for c in curves[False]] == [0.0, 0.0, 0.0]  # best 0 at check 1, then 2 without a gain
    assert [c["val_success"] for c in curves[True]] == values[:8]  # best 0.3 at check 6, then 0.2, 0.2: stopped
    # the cache: the same key either way; a plateau of 0 is retrained under the rule, a positive one is reused
    assert Plateau([(4, 7)], patience_from_success=True).key_fields() == Plateau([(4, 7)]).key_fields()
    off = Plateau([(4, 7)], every=2, patience=1)
    on = Plateau([(4, 7)], every=2, patience=1, patience_from_success=True)
    small = OptimizerConfig(lr=1e-3, minibatch_size=8)
    _, _, root = cached_warm_start(cfg, [(4, 0)], 8, small, cache_dir=tmp_path, resolution=32, stop=off)
    rec = json.loads((root / "warm_start.json").read_text())
    assert rec["plateau"] == 0.0 and rec["stopped_at"] == 4  # the tiny policy never succeeds: stopped at 0
    _, _, again = cached_warm_start(cfg, [(4, 0)], 8, small, cache_dir=tmp_path, resolution=32, stop=on)
    rec = json.loads((again / "warm_start.json").read_text())
    assert again == root and rec["stopped_at"] == 8 and rec["plateau"] == 0.0  # retrained, to the cap this time
    for marked in ({**rec, "stopped_at": -1},  # trained under the rule: what it trains, a plateau of 0 too
                   {**rec, "stop": {**rec["stop"], "patience_from_success": False}, "plateau": 0.25,
                    "stopped_at": -2}):  # without it, but it succeeded: the same weights either way
        (root / "warm_start.json").write_text(json.dumps(marked))
        cached_warm_start(cfg, [(4, 0)], 8, small, cache_dir=tmp_path, resolution=32, stop=on)
        assert json.loads((root / "warm_start.json").read_text())["stopped_at"] == marked["stopped_at"]  # reused


def test_a_converged_start_is_reused_under_a_higher_step_cap(tmp_path):
    """A start that stopped on patience at step s is what any cap >= s trains, so raising the cap (as the
    not-converged error asks for another N of the demo search) reuses it; a cap below s does not."""
    from pi0.ript.warm_start import Plateau, cached_warm_start
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    stop = Plateau([(4, 7)], every=2, patience=1, require_convergence=True)
    opt = OptimizerConfig(lr=1e-3, minibatch_size=8)
    _, _, root = cached_warm_start(cfg, [(4, 0)], 10, opt, cache_dir=tmp_path, resolution=32, stop=stop)
    rec = json.loads((root / "warm_start.json").read_text())
    assert rec["stopped_at"] == 4 and rec["converged_key"]  # checks at 2 and 4 (0.0, then no gain: patience 1)
    _, _, again = cached_warm_start(cfg, [(4, 0)], 20, opt, cache_dir=tmp_path, resolution=32, stop=stop)
    assert again == root and len(list(root.parent.iterdir())) == 1  # nothing retrained
    with pytest.raises(UserError, match="did not converge"):  # cap 2 < 4: retrained, and capped before patience
        cached_warm_start(cfg, [(4, 0)], 2, opt, cache_dir=tmp_path, resolution=32, stop=stop)
    other = Plateau([(4, 7)], every=2, patience=2, require_convergence=True)  # another rule: its own start
    _, _, third = cached_warm_start(cfg, [(4, 0)], 20, opt, cache_dir=tmp_path, resolution=32, stop=other)
    assert third != root


def test_a_capped_start_resumes_under_a_higher_cap_to_the_uninterrupted_run(tmp_path):
    """The not-converged error asks for a higher cap; the rerun continues from the last check (weights, AdamW, RNGs,
    curve, patience) instead of retraining, and ends where one run under the higher cap ends, to the bit."""
    from dataclasses import replace

    from pi0.ript.warm_start import Plateau, arena_expert_demos, cached_warm_start, demo_windows, sft_to_plateau
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    opt = OptimizerConfig(lr=1e-2, minibatch_size=4)
    stop = Plateau([(4, 7), (4, 8)], every=2, patience=50, require_convergence=True)

    def fresh():
        pol = tiny_arena_policy(cfg, default_norm_stats(8, 7))
        return pol, demo_windows(pol, arena_expert_demos([(0, 0), (4, 0)], 4, 2, resolution=32))
    partial = tmp_path / "start.partial.pt"
    runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=6)
    try:
        torch.manual_seed(0)
        pol, windows = fresh()
        with pytest.raises(UserError, match="resumes at step 6"):
            sft_to_plateau(pol, windows, opt, 6, stop, runner, log=False, resume=partial)
        saved = torch.load(partial, weights_only=True)
        torch.manual_seed(0)
        pol, windows = fresh()
        with pytest.raises(UserError, match="resumes at step 10"):
            sft_to_plateau(pol, windows, opt, 10, stop, runner, log=False, resume=partial)
        resumed = torch.load(partial, weights_only=True)
        torch.manual_seed(0)
        ref, windows = fresh()
        with pytest.raises(UserError, match="cap 10"):
            sft_to_plateau(ref, windows, opt, 10, stop, runner, log=False)
        # the partial of a run past the cap is not what the cap trains: ignored
        torch.manual_seed(0)
        short, windows = fresh()
        curve = sft_to_plateau(short, windows, opt, 4, replace(stop, require_convergence=False), runner, log=False,
                               resume=partial)
    finally:
        runner.close()
    assert saved["done"] == 6 and resumed["done"] == 10 and [c["steps"] for c in curve] == [2, 4]
    assert resumed["curve"][:3] == saved["curve"]  # the first three checks were loaded, not rerun (their timings too)
    for name, v in ref.model.state_dict().items():  # the uninterrupted run's weights, to the bit
        assert torch.equal(v, pol.model.state_dict()[name]) and torch.equal(v, resumed["model"][name]), name
    assert any(not torch.equal(v, saved["model"][n]) for n, v in ref.model.state_dict().items())  # it trained on
    # the cached start deletes its partial once the start is stored
    quick = Plateau([(4, 7)], every=2, patience=1, require_convergence=True)
    _, _, root = cached_warm_start(cfg, [(4, 0)], 10, OptimizerConfig(lr=1e-3, minibatch_size=8), cache_dir=tmp_path,
                                   resolution=32, stop=quick)
    assert (root / "model.safetensors").is_file() and not list(root.parent.glob("*.partial.pt*"))


def test_cool_down_decays_the_step_size_linearly_to_zero():
    """By hand: 40 steps at lr 1e-2 warm up over 2 (5%), then lr x (1 - i/40): 0.5 x 1e-2, 39/40 x 1e-2, ...,
    1/40 x 1e-2; the scale is restored after each step, and the weights move."""
    from pi0.ript.warm_start import arena_expert_demos, cool_down, demo_windows
    policy = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2,
                                               num_steps=2), default_norm_stats(8, 7))
    windows = demo_windows(policy, arena_expert_demos([(4, 0)], 4, 2, resolution=32))
    before = {n: v.clone() for n, v in policy.model.state_dict().items()}
    lrs: list[float] = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    try:
        cool_down(policy, windows, OptimizerConfig(lr=1e-2, minibatch_size=4), 40)
    finally:
        hook.remove()
    np.testing.assert_allclose(lrs, [1e-2 * min(1.0, (i + 1) / 2) * (1 - i / 40) for i in range(40)], rtol=1e-12)
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2 * 39 / 40) and lrs[-1] == pytest.approx(
        1e-2 / 40)
    assert not policy.model.training
    assert any(not torch.equal(v, before[n]) for n, v in policy.model.state_dict().items())


def test_a_cooled_start_is_cached_beside_the_start_it_cools(tmp_path):
    """cooldown=n: the plateau's start (cached under its own key, as without a cooldown), then n decayed steps,
    cached as <key>-cool<n> with the validation check of the cooled weights; a second call loads both."""
    from pi0.ript.warm_start import Plateau, cached_warm_start
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    stop = Plateau([(4, 7)], every=2, patience=1, require_convergence=True)
    opt = OptimizerConfig(lr=1e-3, minibatch_size=8)
    base_pol, _, base = cached_warm_start(cfg, [(4, 0)], 10, opt, cache_dir=tmp_path, resolution=32, stop=stop)
    cooled_pol, windows, cooled = cached_warm_start(cfg, [(4, 0)], 10, opt, cache_dir=tmp_path, resolution=32,
                                                    stop=stop, cooldown=6)
    assert cooled == base.with_name(base.name + "-cool6") and windows
    rec, base_rec = (json.loads((r / "warm_start.json").read_text()) for r in (cooled, base))
    assert rec["cooldown"] == 6 and rec["base"] == base.name and 0.0 <= rec["val_after_cooldown"] <= 1.0
    assert rec["curve"] == base_rec["curve"] and rec["plateau"] == base_rec["plateau"]
    moved = [n for n, v in cooled_pol.model.state_dict().items() if not torch.equal(v, base_pol.model.state_dict()[n])]
    assert moved
    again, _, root = cached_warm_start(cfg, [(4, 0)], 20, opt, cache_dir=tmp_path, resolution=32, stop=stop,
                                       cooldown=6)  # the converged start under a higher cap: both reused
    assert root == cooled and sorted(p.name for p in tmp_path.joinpath("ript_warm_start").iterdir()) == sorted(
        [base.name, cooled.name])
    for n, v in again.model.state_dict().items():
        assert torch.equal(v, cooled_pol.model.state_dict()[n]), n
    with pytest.raises(UserError, match="cooldown must be >= 0"):
        cached_warm_start(cfg, [(4, 0)], 10, opt, cache_dir=tmp_path, resolution=32, stop=stop, cooldown=-1)


def test_rft_windows_are_the_successful_rollouts_only(arena_policy):
    from pi0.ript.collection import Collection, Group
    from pi0.ript.warm_start import success_windows

    eps = [_episode(2), _episode(3), _episode(2)]
    col = Collection(groups=[Group((0, 0), eps, np.array([1.0, 0.0, 1.0]), np.array([0.5, -1.0, 0.5]))])
    ws = success_windows(FlowMatchingObjective(arena_policy), col)
    assert len(ws) == 4 and all(w["advantage"] == 0.0 for w in ws)  # 2 + 2 decisions of the two successes


def test_rft_collects_with_the_rl_arms_stochastic_step(arena_policy):
    """RFT's rollouts come from the RL arm's collector: the same fixed Flow-SDE step (a uniformly drawn one was a bug)
    and the same kind of step (cps: its std, 0.5 here, shows in the recorded log-densities)."""
    import copy

    from pi0.ript.warm_start import rft

    steps: dict[tuple, set] = {}
    lps: dict[tuple, list] = {}
    for sde_step, kind in ((1, "flow_sde"), (-1, "flow_sde"), (0, "cps")):
        seen: set = set()
        lp: list = []

        def callback(st: dict) -> None:
            for g in st["collection"].groups:
                for ep in g.episodes:
                    seen.update(int(d.extras["sde_step"]) for d in ep.decisions)
                    lp.extend(np.asarray(d.extras["log_prob"]).ravel() for d in ep.decisions)

        runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=8)
        try:
            rft(copy.deepcopy(arena_policy), [], runner, InitStateSampler({4: range(8)}), OptimizerConfig(lr=1e-4),
                seconds=1e-3, num_groups=2, group_size=2, steps_per_iteration=1, callback=callback, sde_step=sde_step,
                sde_kind=kind)
        finally:
            runner.close()
        steps[sde_step, kind], lps[sde_step, kind] = seen, lp
    assert steps[1, "flow_sde"] == {1}
    assert steps[-1, "flow_sde"] <= {0, 1} and len(steps[-1, "flow_sde"]) == 2  # -1 (RLinf's uniform draw) varies it
    assert steps[0, "cps"] == {0}
    # 2 Euler steps, cps at step 0 with eta 1: std = 0.5, so E[log N] = -log 0.5 - 1/2 - log(2 pi)/2 = -0.726
    # (flow_sde at a = 1 would draw std 1: -1.419)
    assert abs(np.concatenate(lps[0, "cps"]).mean() - (-math.log(0.5) - 0.5 - 0.5 * math.log(2 * math.pi))) < 0.1


def test_collection_windows_episode_mean():
    """algo.episode_mean: the windows of one RLOO group (a 2-decision success, a 6-decision failure) sum to 0; without
    it each window carries its episode's advantage."""
    from types import SimpleNamespace

    from pi0.ript.collection import Collection, Group
    from pi0.ript.trainer import collection_windows

    class Obj:
        def episode_windows(self, ep, advantage, reward):
            return [{"advantage": advantage} for _ in ep.decisions]

    eps = [SimpleNamespace(decisions=[0] * 2), SimpleNamespace(decisions=[0] * 6)]
    col = Collection(groups=[Group((4, 0), eps, np.array([1.0, 0.0]), rloo_advantages(np.array([[1.0, 0.0]]))[0])])
    plain = [w["advantage"] for w in collection_windows(Obj(), col)]
    assert plain == [1.0] * 2 + [-1.0] * 6
    scaled = [w["advantage"] for w in collection_windows(Obj(), col, episode_mean=True)]
    np.testing.assert_allclose(scaled, [2.0] * 2 + [-2 / 3] * 6)
    assert abs(sum(scaled)) < 1e-12


def test_rft_collects_as_the_cfg_arm_collects():
    """RFT beside a cfg RL arm rolls out with the same collector (``collection.rl_collector``): the deterministic
    sampler (its extras hold the sampled chunk, no Flow-SDE chain); beside ppo, the Flow-SDE collector."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.collection import SDEChunkPolicy, rl_collector
    from pi0.ript.warm_start import TinyArenaConfig, rft, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    kinds: set = set()

    def callback(st: dict) -> None:
        kinds.update(tuple(sorted(k for k in ("chain", "model_actions") if k in d.extras))
                     for g in st["collection"].groups for ep in g.episodes for d in ep.decisions)

    runner = arena_runner(4, replan_steps=2, resolution=32, max_steps=6)
    try:
        rft(pol, [], runner, InitStateSampler({4: range(4)}), OptimizerConfig(lr=1e-4), seconds=1e-3, num_groups=1,
            group_size=2, steps_per_iteration=1, callback=callback, rl_objective="cfg")
    finally:
        runner.close()
    assert kinds == {("model_actions",)}
    assert isinstance(rl_collector(pol, "ppo", 1.0, 0, torch.Generator()), SDEChunkPolicy)


def test_demo_anchor_adds_the_flow_loss_of_the_drawn_demos():
    """algo.demo_coef (``update.DemoAnchor``): each minibatch's loss is the objective's plus coef x the flow loss of
    ``batch_size`` demos drawn without replacement from the anchor's own stream (seed + 1); the first AdamW step then
    moves each weight by -lr x the sign of that summed gradient, not the objective's alone."""
    import copy

    from pi0.ript.update import DemoAnchor, PolicyUpdate

    torch.manual_seed(3)
    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2),
                            default_norm_stats(8, 7))
    ref = copy.deepcopy(pol)
    ws = FlowMatchingObjective(pol).episode_windows(_episode(2))
    demos = FlowMatchingObjective(pol).episode_windows(_episode(3, valid_last=2))
    for i, d in enumerate(demos):
        d["actions"] = d["actions"] * 0 + 0.1 * (i + 1)  # targets unlike the windows', so the two gradients differ
    coef, seed, lr = 2.0, 5, 1e-4
    upd = PolicyUpdate(FlowMatchingObjective(pol), OptimizerConfig(lr=lr, minibatch_size=4, max_grad_norm=0), seed=seed,
                       anchor=DemoAnchor(demos, coef, batch_size=2))
    st = upd.step(ws)
    assert st["steps"] == 1 and "demo_loss" in st

    # by hand, on the copy: the same minibatch order and flow noise, the demos the anchor's stream draws
    obj = FlowMatchingObjective(ref)
    order = np.random.default_rng(seed).permutation(len(ws))
    drawn = np.random.default_rng(seed + 1).choice(len(demos), size=2, replace=False)
    ref.model.train()
    main, _ = obj.loss(obj.collate([ws[i] for i in order]), torch.Generator().manual_seed(seed))
    demo, _ = obj.loss(obj.collate([demos[i] for i in drawn]), torch.Generator().manual_seed(seed + 1))
    assert abs(float(demo.detach()) - st["demo_loss"]) < 1e-6
    params = [p for p in ref.model.parameters() if p.requires_grad]
    g_main = torch.autograd.grad(main, params, allow_unused=True)
    g_demo = torch.autograd.grad(demo, params, allow_unused=True)
    agree = disagree_main = 0
    for p0, p1, gm, gd in zip(params, [p for p in pol.model.parameters() if p.requires_grad], g_main, g_demo):
        if gm is None or gd is None:
            continue
        g = gm + coef * gd
        big = g.abs() > 1e-5
        step = (p1.detach() - p0.detach())[big]
        torch.testing.assert_close(step, -lr * torch.sign(g[big]), rtol=0.02, atol=1e-7)
        agree += int(big.sum())
        disagree_main += int((torch.sign(gm[big]) != torch.sign(g[big])).sum())
    assert agree > 1000 and disagree_main > 100  # the anchor changed the step's direction in many weights

    with pytest.raises(ValueError, match="demo anchor needs demo windows"):
        PolicyUpdate(FlowMatchingObjective(pol), anchor=DemoAnchor([], 1.0))
    with pytest.raises(ValueError, match="algo.demo_coef=0.5 needs demo windows"):
        RIPTTrainer(pol, None, None, RLConfig(demo_coef=0.5))
