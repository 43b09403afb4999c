"""Collection: K rollouts per sampled init state, RLOO advantages, dynamic sampling, and the stochastic sampler.

``RolloutGenerator.collect`` rolls out groups of K episodes from init states drawn by the sampler (skipping states the
history marks solved), scores them with the reward, computes RLOO advantages and keeps the informative groups (not all
K rewards equal), in rounds until it has enough or runs out of attempts. Under torchrun a shared counter
(``pi0.ript.algos.rl_optimizers.file_counter`` / ``store_counter``) makes the ranks stop together once the kept groups
of all ranks reach the global target. ``SDEChunkPolicy`` is the PPO objective's collector (Flow-SDE sampling).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pi0.models.flow_sde import sampler_step
from pi0.policies.libero import Pi0ChunkPolicy, construct_libero_observation, window_extras
from pi0.rollout import ChunkPolicy, Episode, RolloutRunner
from pi0.rollout.types import PolicyOutput
from pi0.ript.algos.rloo import informative_groups, rloo_advantages
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.reward_function import BinarySuccessReward


@dataclass
class Group:
    """K episodes of one init state with their rewards (K,) and RLOO advantages (K,)."""

    state: tuple[int, int]
    episodes: list[Episode]
    rewards: np.ndarray
    advantages: np.ndarray


@dataclass
class Collection:
    """Result of one :meth:`RolloutGenerator.collect` call."""

    groups: list[Group]  # kept (informative) groups
    num_groups: int = 0  # groups rolled out
    num_skipped_states: int = 0  # states skipped by the history
    attempts: int = 0  # collection rounds used
    success_rate: float = 0.0  # over every rollout of this call
    rollout_time: float = 0.0
    exhausted: str = ""  # why collection stopped early ("" if it got enough groups)
    all_rewards: list[np.ndarray] = field(default_factory=list)

    @property
    def frac_kept(self) -> float:
        """Fraction of rolled-out groups kept by dynamic sampling."""
        return len(self.groups) / self.num_groups if self.num_groups else 0.0


def groups_to_start(need: int, kept: int, rolled: int, oversample: float, cap: int) -> int:
    """How many groups a collection round starts to keep ``need`` informative ones: ceil(need x oversample / q), q =
    (kept + 3) / (rolled + 4) the kept fraction of the groups rolled so far (smoothed towards 3/4), within
    [need, max(need, cap)]; ``oversample`` <= 0 starts exactly ``need`` (sequential rounds)."""
    if oversample <= 0:
        return need
    q = (kept + 3.0) / (rolled + 4.0)
    return int(min(max(need, math.ceil(need * oversample / q - 1e-9)), max(need, cap)))


def kept_prefix(done: dict[int, float], num_groups: int, group_size: int, need: int, dynamic_sampling: bool = True
                ) -> int | None:
    """Finished episodes' rewards {request index: reward} of ``num_groups`` groups -> the number of leading groups
    (in the sampler's order) that hold the first ``need`` informative ones, once that is decided; None while it
    is not (a group is decided when all its ``group_size`` episodes are done; dynamic sampling off: every group
    counts)."""
    count = 0
    for g in range(num_groups):
        r = [done.get(g * group_size + k) for k in range(group_size)]
        if any(x is None for x in r):
            return None
        count += int(not dynamic_sampling or min(r) != max(r))
        if count >= need:
            return g + 1
    return None


class RolloutGenerator:
    """Collects ``num_groups`` groups of ``group_size`` rollouts per call (bounded by ``max_attempts`` rounds).

    ``oversample`` > 0: each round starts enough groups that dynamic sampling rarely needs another round
    (:func:`groups_to_start`, at most ``max_groups`` in flight), keeps the first informative ones in the sampler's
    order (the groups sequential rounds would keep), abandons the rest as soon as that is decided, and gives their
    states back to the sampler. 0: sequential rounds of exactly the missing number of groups.
    """

    def __init__(self, runner: RolloutRunner, policy: ChunkPolicy, sampler: InitStateSampler, group_size: int = 8,
                 dynamic_sampling: bool = True, history: InitStateHistory | None = None, max_attempts: int = 3,
                 reward: BinarySuccessReward | None = None, oversample: float = 0.0, max_groups: int = 0):
        if group_size < 2:
            raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
        if oversample < 0:
            raise ValueError(f"oversample must be >= 0 (0: sequential rounds), got {oversample}")
        self.runner, self.policy, self.sampler = runner, policy, sampler
        self.group_size = group_size
        self.dynamic_sampling = dynamic_sampling
        self.history = history
        self.max_attempts = max(1, int(max_attempts))
        self.reward = reward or BinarySuccessReward()
        self.oversample = float(oversample) if dynamic_sampling else 0.0
        self.max_groups = int(max_groups)
        self.kept_total = self.rolled_total = 0  # over this generator's life: the kept fraction for oversampling

    def _pick_states(self, n: int) -> tuple[list[tuple[int, int]], int]:
        """Up to ``n`` states not skipped by the history (one pass over the sampler at most) + skip count."""
        out, skipped = [], 0
        for _ in range(len(self.sampler)):
            if len(out) == n:
                break
            s = self.sampler.next()
            if self.history is not None and self.history.should_skip(s):
                skipped += 1
                continue
            out.append(s)
        return out, skipped

    def _round(self, states: list[tuple[int, int]], need: int) -> tuple[list[Episode], int]:
        """Roll out K episodes of each state -> (episodes of the groups used, in order; number of groups used).
        Oversampled: stops once the first ``need`` informative groups are decided; the later states go back."""
        k = self.group_size
        if len(states) <= need:  # nothing to stop early for
            return self.runner.run(states, group_size=k, policy=self.policy), len(states)
        outcome: dict[int, float] = {}
        result: list[int | None] = [None]

        def stop(finished: dict[int, Episode]) -> bool:
            for i, ep in finished.items():
                outcome.setdefault(i, float(self.reward(ep)))
            result[0] = kept_prefix(outcome, len(states), k, need, self.dynamic_sampling)
            return result[0] is not None

        finished = self.runner.run_until(states, k, stop, policy=self.policy)
        used = result[0] if result[0] is not None else len(states)
        self.sampler.put_back(states[used:])
        return [finished[i] for i in range(used * k)], used

    def _collect(self, num_groups: int, max_attempts: int) -> Collection:
        """Roll out groups until ``num_groups`` informative ones are kept or ``max_attempts`` rounds are used."""
        col = Collection(groups=[])
        t0 = time.perf_counter()
        successes = []
        while len(col.groups) < num_groups:
            if col.attempts >= max_attempts:
                col.exhausted = (f"stopped after {col.attempts} collection rounds with {len(col.groups)}/{num_groups} "
                                 "informative groups (every sampled state was solved or failed in all rollouts)")
                break
            col.attempts += 1
            need = num_groups - len(col.groups)
            n = groups_to_start(need, self.kept_total, self.rolled_total, self.oversample, self.max_groups)
            states, skipped = self._pick_states(n)
            col.num_skipped_states += skipped
            if not states:
                col.exhausted = "every init state is solved (skipped by the history); nothing left to collect"
                break
            episodes, used = self._round(states, need)
            states = states[:used]
            rewards = self.reward.group_rewards(episodes, self.group_size)
            adv = rloo_advantages(rewards)
            keep = informative_groups(rewards) if self.dynamic_sampling else np.ones(len(states), bool)
            successes.extend(rewards.ravel().tolist())
            col.num_groups += len(states)
            self.rolled_total += len(states)
            self.kept_total += int(keep.sum())
            for g, s in enumerate(states):
                if self.history is not None:
                    self.history.update(s, rewards[g])
                col.all_rewards.append(rewards[g])
                if keep[g]:
                    eps = episodes[g * self.group_size: (g + 1) * self.group_size]
                    col.groups.append(Group(s, eps, rewards[g], adv[g]))
        col.success_rate = float(np.mean(successes)) if successes else 0.0
        col.rollout_time = time.perf_counter() - t0
        return col

    def collect(self, num_groups: int, counter: Any = None, global_target: int = 0) -> Collection:
        """``num_groups`` informative groups (bounded by ``max_attempts`` rounds). With a shared ``counter`` (torchrun):
        one round at a time, each adding its kept groups to the counter, until all ranks' total reaches
        ``global_target``."""
        if counter is None:
            return self._collect(num_groups, self.max_attempts)
        total = Collection(groups=[])
        succ, n = 0.0, 0
        while total.attempts < self.max_attempts:
            need = min(num_groups, global_target - counter.get())
            if need <= 0:
                break
            col = self._collect(need, 1)
            counter.update(len(col.groups))
            total.groups += col.groups
            total.attempts += col.attempts
            total.num_groups += col.num_groups
            total.num_skipped_states += col.num_skipped_states
            total.rollout_time += col.rollout_time
            total.all_rewards += col.all_rewards
            succ += col.success_rate * col.num_groups * self.group_size
            n += col.num_groups * self.group_size
            total.exhausted = col.exhausted
        total.success_rate = succ / n if n else 0.0
        return total

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position and the history (resume)."""
        h = self.history
        return {"sampler_rng": self.sampler.rng.bit_generator.state,
                "sampler_order": [int(i) for i in self.sampler._order], "history": h.to_json() if h is not None else None}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.sampler.rng.bit_generator.state = st["sampler_rng"]
        self.sampler._order = list(st["sampler_order"])
        if st.get("history") is not None and self.history is not None:
            self.history.load_json(st["history"])


class SDEChunkPolicy:
    """Batched ``ChunkPolicy`` that samples with Flow-SDE (``PI0Model.sample_actions_sde``) and records, per decision,
    what the PPO update needs: the denoising chain, the stochastic step and its elementwise log-density, beside the
    observation extras of ``Pi0ChunkPolicy`` (client images, model-space state, prompt tokens).

    ``record_prefix``: while the model's prefix is frozen (``PI0Model.caches_prefix``, ``trainable=expert``), each
    decision also keeps the prefix's kv cache the sampler computed (``PREFIX_KEYS``: packed (depth, Tp, 2K, H) and
    pad (Tp,), on the model's device), so that the update runs the action expert on it instead of encoding the
    observation again (``PPOObjective.episode_windows``); :func:`release_prefixes` frees them."""

    def __init__(self, policy: Any, noise_level: float, generator: torch.Generator | None = None,
                 sde_step: int | None = None, sde_kind: str = "flow_sde", record_prefix: bool = False):
        self.policy, self.noise_level, self.generator = policy, float(noise_level), generator
        self.sde_step = sde_step  # the stochastic denoising step: None = drawn uniformly per call (RLinf), or fixed
        self.sde_kind = sde_kind  # the step's transition: "flow_sde" | "cps" (pi0.models.flow_sde)
        self.record_prefix = bool(record_prefix)

    @torch.no_grad()
    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """n raw observations -> PolicyOutput(actions (n, H, 7) float64, extras incl. chain / sde_step / log_prob)."""
        pol = self.policy
        observation, arrays = construct_libero_observation(obs, prompts, pol)
        inp = pol.prepare_inputs(observation)
        cfg = pol.config.model
        noise = torch.randn(len(obs), cfg.action_horizon, cfg.action_dim, generator=self.generator).to(pol.device)
        keep_prefix = self.record_prefix and pol.model.serves_cached_prefix()
        rec = pol.model.sample_actions_sde(inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"],
                                           inp["state"], noise, pol.config.num_steps, self.noise_level,
                                           sde_step=self.sde_step, generator=self.generator, sde_kind=self.sde_kind,
                                           return_prefix=keep_prefix)
        actions = pol.postprocess_actions(rec["actions"], inp["state"])
        extras = {**window_extras(arrays, inp["state"], inp["lang_tokens"], inp["lang_masks"]),
                  "chain": rec["chain"].cpu().numpy(), "sde_step": np.full(len(obs), rec["sde_step"]),
                  "log_prob": rec["log_prob"].cpu().numpy()}
        if "value" in rec:  # the value head's V of each observation (PPO's per-decision baseline)
            extras["value"] = rec["value"].cpu().numpy()
        if keep_prefix:  # torch tensors on the model's device: the runner slices them per decision like the arrays
            extras.update(zip(PREFIX_KEYS, rec["prefix"]))
        return PolicyOutput(actions=actions.numpy(), extras=extras)


PREFIX_KEYS = ("_prefix_kv", "_prefix_pad")  # decision extras of SDEChunkPolicy(record_prefix=True)


def release_prefixes(episodes: Sequence[Episode]) -> None:
    """Drop the recorded prefix caches of ``episodes``' decisions (their memory back once the update used them)."""
    for ep in episodes:
        for d in ep.decisions:
            for k in PREFIX_KEYS:
                d.extras.pop(k, None)


def sde_collector(policy: Any, noise_level: float, sde_step: int, generator: torch.Generator,
                  sde_kind: str = "flow_sde", record_prefix: bool = False) -> SDEChunkPolicy:
    """The Flow-SDE collector of ``algo.sde_step`` (-1: a uniformly drawn step per call, -2: every step) and
    ``algo.sde_kind``,
    shared by the RL arm and RFT so that both collect exactly alike (``record_prefix``: the RL arm's frozen-prefix
    caches for its update, ``SDEChunkPolicy``)."""
    return SDEChunkPolicy(policy, noise_level, generator, sampler_step(sde_step), sde_kind,
                          record_prefix)


def rl_collector(policy: Any, objective: str, noise_level: float, sde_step: int, generator: torch.Generator,
                 sde_kind: str = "flow_sde", record_prefix: bool = False) -> ChunkPolicy:
    """The collector an RL objective samples with, shared by the RL arm and RFT so that both collect exactly alike:
    ppo's Flow-SDE (:func:`sde_collector`); cfg the deterministic sampler the policy is scored with, its initial
    noise drawn per decision from ``generator`` (``Pi0ChunkPolicy``, at the policy's w)."""
    if objective == "ppo":
        return sde_collector(policy, noise_level, sde_step, generator, sde_kind, record_prefix)
    return Pi0ChunkPolicy(policy, generator)
