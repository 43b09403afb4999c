"""Every env of an iteration in flight: how many groups a round starts, which it keeps, the runner's early stop, and
that an oversampled collection keeps exactly the groups sequential rounds keep (hand-checked and on the arena)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pi0.rollout import ArenaExpertPolicy, Episode, RolloutRunner, RunnerConfig, ZeroChunkPolicy
from pi0.envs import make_env_spec
from pi0.ript.collection import RolloutGenerator, groups_to_start, kept_prefix
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.reward_function import BinarySuccessReward
from pi0.ript.warm_start import arena_runner


# ----------------------------------------------------------------------------- pure functions
def test_groups_to_start_by_hand():
    # nothing rolled yet: q = 3/4, so 4 x 1.25 / 0.75 = 6.67 -> 7 groups; the runner's cap wins
    assert groups_to_start(4, 0, 0, 1.25, 16) == 7
    assert groups_to_start(4, 0, 0, 1.25, 6) == 6
    # half of the 20 groups rolled so far were kept: q = 13/24, 4 x 1.25 / q = 9.23 -> 10, capped at 8
    assert groups_to_start(4, 10, 20, 1.25, 16) == math.ceil(4 * 1.25 / (13 / 24)) == 10
    assert groups_to_start(4, 10, 20, 1.25, 8) == 8
    # every group kept so far: q -> 1 (from below), the start is about need x oversample
    assert groups_to_start(4, 997, 997, 1.2, 16) == 5
    # off (0) or a cap below need: exactly the missing groups
    assert groups_to_start(3, 0, 0, 0.0, 16) == 3
    assert groups_to_start(3, 0, 0, 1.25, 1) == 3


def test_kept_prefix_waits_for_earlier_groups_by_hand():
    k = 2
    # group 0 informative (1, 0), group 1 all fail, group 2 informative: need 2 -> the first 3 groups
    done = {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 1.0}
    assert kept_prefix(done, 4, k, 2) == 3
    assert kept_prefix(done, 4, k, 1) == 1
    # group 1 unfinished: group 2's outcome cannot be used yet, whatever it is
    assert kept_prefix({0: 1.0, 1: 0.0, 2: 0.0, 4: 0.0, 5: 1.0}, 4, k, 2) is None
    # not enough informative groups among all of them: undecided (the round runs to its end)
    assert kept_prefix({0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}, 2, k, 1) is None
    # dynamic sampling off: every finished group counts
    assert kept_prefix({0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}, 2, k, 2, dynamic_sampling=False) == 2


def test_sampler_put_back_redraws_the_same_states_in_order():
    s = InitStateSampler({0: range(10), 3: range(5)}, seed=4)
    drawn = s.sample(6)
    s.put_back(drawn[2:])
    assert s.sample(4) == drawn[2:]
    twin = InitStateSampler({0: range(10), 3: range(5)}, seed=4)
    twin.sample(6)
    assert s.sample(12) == twin.sample(12)  # the pass continues as if nothing was put back


# ----------------------------------------------------------------------------- runner: early stop
@pytest.mark.parametrize("subprocess", [False, True])
def test_run_until_abandons_the_running_episodes_and_leaves_the_envs_clean(subprocess):
    spec = make_env_spec("arena", resolution=32, num_init_states=50)
    cfg = RunnerConfig(num_envs=4, replan_steps=5, max_steps=60, use_subprocess=subprocess)
    states = [(4, i) for i in range(6)]
    with RolloutRunner(spec, None, cfg) as runner:
        # the expert finishes its states at different steps: stop after the first two finished episodes
        got = runner.run_until(states, 2, lambda fin: len(fin) >= 2, policy=ArenaExpertPolicy(horizon=10))
        assert 2 <= len(got) < 12 and runner.last_stats.abandoned > 0
        assert all(isinstance(e, Episode) and e.index == i for i, e in got.items())
        again = runner.run(states[:2], group_size=2, policy=ArenaExpertPolicy(horizon=10))
    with RolloutRunner(spec, None, cfg.replace(use_subprocess=False)) as fresh:
        ref = fresh.run(states[:2], group_size=2, policy=ArenaExpertPolicy(horizon=10))
    assert [(e.success, e.length) for e in again] == [(e.success, e.length) for e in ref]


@pytest.mark.parametrize("envs_per_worker", [1, 3])
def test_overlapped_cohorts_give_the_same_episodes(envs_per_worker):
    """overlap=True: two cohorts of env processes take turns (one steps while the other's policy call runs); every
    episode is the same as in lock-step rounds, and each policy call carries at most one cohort's envs."""
    spec = make_env_spec("arena", resolution=32, num_init_states=50)
    states = [(4, i) for i in range(5)]
    out = {}
    for overlap in (False, True):
        cfg = RunnerConfig(num_envs=6, envs_per_worker=envs_per_worker, replan_steps=5, max_steps=40, overlap=overlap)
        with RolloutRunner(spec, None, cfg) as runner:
            eps = runner.run(states, group_size=2, policy=ArenaExpertPolicy(horizon=10))
            out[overlap] = ([(e.index, e.success, e.length, e.total_reward) for e in eps],
                            max(runner.last_stats.batch_sizes))
    assert out[True][0] == out[False][0] and len(out[True][0]) == 10
    assert out[False][1] == 6 and out[True][1] <= 3


# ----------------------------------------------------------------------------- collection: same groups kept
class HashReward(BinarySuccessReward):
    """A reward fixed by (init state, sample): which groups are informative does not depend on the rollout."""

    def __call__(self, episode: Episode) -> float:
        return float((episode.init_state_id * 7 + episode.sample_index * 3) % 5 == 0)


def _collect(oversample: float, num_envs: int, history: bool = False):
    runner = arena_runner(num_envs, replan_steps=5, resolution=32, max_steps=5, num_init_states=60)
    sampler = InitStateSampler({4: range(60)}, seed=1)
    try:
        gen = RolloutGenerator(runner, ZeroChunkPolicy(horizon=10), sampler, group_size=3, max_attempts=10,
                               reward=HashReward(), oversample=oversample, max_groups=num_envs // 3,
                               history=InitStateHistory() if history else None)
        cols = [gen.collect(3) for _ in range(3)]
        return cols, sampler.sample(5), gen.history
    finally:
        runner.close()


@pytest.mark.parametrize("history", [False, True])
def test_oversampled_collection_keeps_the_groups_sequential_rounds_keep(history):
    seq, seq_next, seq_hist = _collect(0.0, 9, history)
    over, over_next, over_hist = _collect(2.0, 24, history)
    assert [[g.state for g in c.groups] for c in over] == [[g.state for g in c.groups] for c in seq]
    for a, b in zip(over, seq):
        assert [g.rewards.tolist() for g in a.groups] == [g.rewards.tolist() for g in b.groups]
        assert a.num_groups == b.num_groups and len(a.groups) == 3
    assert over_next == seq_next  # the states past the kept ones went back to the sampler
    assert sum(c.attempts for c in over) < sum(c.attempts for c in seq)  # fewer rounds
    if history:
        assert over_hist.to_json() == seq_hist.to_json()


def test_oversample_is_validated():
    with pytest.raises(ValueError, match="oversample"):
        RolloutGenerator(None, None, InitStateSampler({0: [0]}), oversample=-1.0)


def test_task_affinity_where_a_task_switch_rebuilds_the_simulator():
    """MetaWorld switches tasks by rebuilding its sim (about 1 s against 40 ms for a same-task reset), so the runner
    gives an episode to a worker whose env has its task; the arena switches in place, so it does not."""
    cfg = RunnerConfig(num_envs=1, use_subprocess=False)
    with RolloutRunner(make_env_spec("metaworld", resolution=32), None, cfg) as mw:
        info = mw.vec_env.env_ready_info(0)
        assert info["supports_task_switch"] and not info["cheap_task_switch"] and mw.task_affinity
    with RolloutRunner(make_env_spec("arena", resolution=32), None, cfg) as arena:
        assert arena.vec_env.env_ready_info(0)["cheap_task_switch"] and not arena.task_affinity
