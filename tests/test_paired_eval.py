"""Paired evaluation: each episode's noise is keyed to the episode (not to the batch it lands in), and the paired
difference's standard error, checked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pi0.evaluation.paired import paired_difference, per_task, rate_se
from pi0.policies.libero import Pi0ChunkPolicy, episode_noise


def test_paired_difference_by_hand():
    a = [1, 1, 0, 1, 0, 1]
    b = [1, 0, 0, 0, 0, 1]
    # d = 0 1 0 1 0 0: mean 1/3, sample variance (4 x 1/9 + 2 x 4/9) / 5 = 4/15
    mean, se = paired_difference(a, b)
    assert mean == pytest.approx(1 / 3)
    assert se == pytest.approx(math.sqrt(4 / 15) / math.sqrt(6))
    # identical outcomes: no difference, no spread
    assert paired_difference(a, a) == (0.0, 0.0)
    # pairing matters: the same marginals in another order give a larger SE
    assert paired_difference(a, b)[1] < paired_difference(a, [0, 0, 1, 0, 1, 1])[1]
    assert rate_se(0.25, 12) == pytest.approx(math.sqrt(0.25 * 0.75 / 12))
    with pytest.raises(ValueError, match="equal 1-D"):
        paired_difference([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([1], [0])


def test_per_task_splits_outcomes_listed_task_by_task():
    got = per_task([3, 4], 2, {"rl": [1, 1, 0, 1], "sft": [0, 0, 0, 0]})
    assert got == {3: {"rl": 1.0, "sft": 0.0}, 4: {"rl": 0.5, "sft": 0.0}}
    with pytest.raises(ValueError, match="rl has 3 outcomes, not 2 tasks x 2"):
        per_task([3, 4], 2, {"rl": [1, 1, 0]})


def test_episode_noise_is_a_function_of_the_key():
    n = episode_noise(7, (4, 1600, 0, 3), (10, 32))
    assert n.shape == (10, 32) and torch.equal(n, episode_noise(7, (4, 1600, 0, 3), (10, 32)))
    others = [episode_noise(7, (4, 1600, 0, 4), (10, 32)), episode_noise(7, (4, 1601, 0, 3), (10, 32)),
              episode_noise(7, (4, 1600, 1, 3), (10, 32)), episode_noise(8, (4, 1600, 0, 3), (10, 32))]
    assert all(not torch.equal(n, o) for o in others)
    assert abs(float(torch.cat([n.flatten()] + [o.flatten() for o in others]).std()) - 1.0) < 0.1


@pytest.mark.parametrize("keyed", [True, False])
def test_keyed_noise_does_not_depend_on_the_batch(keyed):
    """The same states run on 1 env (one episode per call) and on 4 envs (batched, episodes ending at different
    times): with episode keys every decision's noise and chunk agree; without them the noise follows the batch."""
    from pi0.policies.pi0 import default_norm_stats
    from pi0.ript.warm_start import TinyArenaConfig, arena_runner, tiny_arena_policy

    pol = tiny_arena_policy(TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=3),
                            default_norm_stats(8, 7))
    states = [(0, 1), (1, 2), (2, 3), (3, 4)]
    runs = []
    for n_envs in (1, 4):
        with arena_runner(n_envs, replan_steps=2, resolution=32, max_steps=6) as runner:
            policy = Pi0ChunkPolicy(pol, torch.Generator().manual_seed(5), episode_seed=5 if keyed else None)
            assert policy.keyed == keyed
            runs.append(runner.run(states, group_size=1, policy=policy))
    noise = [[np.stack([d.extras["noise"] for d in e.decisions]) for e in eps] for eps in runs]
    same = all(np.array_equal(x, y) for x, y in zip(*noise))
    assert same == keyed
    if keyed:  # the chunks follow from the noise: the episodes are the same
        for x, y in zip(*runs):
            assert np.allclose(np.stack([d.actions for d in x.decisions]), np.stack([d.actions for d in y.decisions]),
                               atol=1e-5)
