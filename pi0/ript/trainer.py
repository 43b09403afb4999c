"""One RIPT-CFG iteration (stages 7-11 through pi0.ript.utils.train_loop; the bench): collect, RLOO, update, eval.

One iteration: ``RolloutGenerator.collect`` (K rollouts per sampled init state, guided by the policy's w; by a frozen
snapshot of the policy with ``behavior="frozen"``, re-taken on a schedule, or only when the trained policy wins a
paired test with ``refresh_gate``),
RLOO advantages and labels, windows from each kept episode's decision points (drawn from a replay of past windows
with ``replay_windows``; plus the warm start's demo windows with ``anchor_ratio``), ``RLOptimizerPI0_CFG.step``,
and (every ``eval_every`` iterations) the success rate on held-out init states. Scalars go to TensorBoard.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.pi0 import PI0Policy
from pi0.rollout import RolloutRunner
from pi0.ript.algos.ppo import PI0_PPO_Adapter, SDEChunkPolicy
from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import PI0_CFG_Adapter, Window
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig, RLOptimizerPI0_CFG
from pi0.ript.algos.rl_optimizers.rollout_generator import Collection, RolloutGenerator
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.replay import WindowReplay


@dataclass
class RLConfig:
    """RIPT-CFG settings: the ``algo`` section of the training config (stage 7: one update pass; stage 8: epochs)."""

    iterations: int = 10
    # "cfg": the CFG-style advantage-conditioned flow-matching objective (below); "ppo": RIPT-VLA's LOOP for flow
    # policies (pi0.ript.algos.ppo): Flow-SDE collection (noise_level; one stochastic denoising step per chunk), and
    # PPO-clipped (clip) ratios of the recorded step's log-density times the episode's RLOO advantage, opt.epochs
    # passes. Evaluation keeps the deterministic sampler.
    objective: str = "cfg"
    trainable: str = "all"  # "all" | "expert" (SigLIP and the VLM frozen; PI0Model.set_trainable)
    noise_level: float = 0.5
    clip: float = 0.2
    num_groups: int = 4  # B init states per iteration
    group_size: int = 8  # K rollouts per init state (rloo_batch_size)
    p_uncond: float = 0.3  # condition dropout
    cfg_guidance: float = 1.0  # w used to collect and evaluate
    target: str = "model_actions"  # "model_actions" | "executed"
    advantage_weighting: bool = False
    # loss weight of windows with A <= 0 (1 = CFGRL: they train the reference); at 0 they are left out of the update
    negative_weight: float = 1.0
    # demo anchor (a DAPG-style demonstration term): each update also trains on round(anchor_ratio x #rollout windows
    # it trains on) windows of the warm start's demos (never new demos), labelled by their demo's outcome (a
    # successful demo is a positive, a failed one of a mixed-quality set trains the reference): both branches stay
    # near the SFT policy. On the tiny arena pi0, training on its own rollouts alone degrades it, and the conditioned
    # branch collapses when only the unconditioned one is anchored (bench/results/rl_diagnosis.md). 0 = off
    anchor_ratio: float = 0.0
    # False: an ablation that leaves the rollout windows out of the update; the anchor keeps its size (anchor_ratio x
    # the rollout windows), so it measures what the rollouts add on top of the demos
    train_on_rollouts: bool = True
    # Which policy collects the rollouts. "current": on-policy, as RIPT. "frozen": a snapshot of the policy taken at
    # the start (and every ``behavior_refresh`` iterations; 0 = never), so both branches fit FIXED targets: the
    # unconditioned one the snapshot's own samples, the conditioned one its successes. That is the setting of
    # CFGRL's improvement guarantee, p_w(a|s) ~ p_ref(a|s) p(success|s,a)^w. On the tiny arena pi0, training on
    # the current policy's own samples compounds its fitting error and degrades it, whereas fitting a frozen
    # copy's samples at the same states is stable (bench/results/rl_diagnosis.md, session 3). The snapshot is a
    # second copy of the weights in memory (about 7 GB for a bf16 pi0).
    behavior: str = "current"
    behavior_refresh: int = 0
    # > 0: a refresh is a test, not a copy. The trained policy and the snapshot each roll out once from the same
    # ``refresh_gate`` training init states with the same flow noise, and the snapshot takes the trained weights only
    # if they succeed more often (summed over ranks). The behaviour policy then never gets worse, and the learner
    # fits its own fit only once per accepted refresh. 0 = refresh unconditionally.
    refresh_gate: int = 0
    # > 0: each update samples its rollout windows from a FIFO of the last ``replay_windows`` (this iteration's
    # included; pi0.ript.replay), ``replay_sample`` of them (0 = as many as this iteration brought), so that its
    # minibatches span many init states instead of this iteration's B (at most the buffer's size, without
    # replacement). 0 = off: each update sees its own iteration's windows.
    replay_windows: int = 0
    replay_sample: int = 0
    dynamic_sampling: bool = True
    max_collect_attempts: int = 3  # collection rounds per iteration before giving up (bounded sampling)
    eval_every: int = 1  # 0 = never
    eval_repeats: int = 1
    opt: OptimizerConfig = field(default_factory=OptimizerConfig)
    seed: int = 0


BEHAVIORS = ("current", "frozen")
OBJECTIVES = ("cfg", "ppo")


def enable_optimality_condition(policy: PI0Policy, guidance: float | None = None) -> PI0Policy:
    """Give ``policy`` the zero-initialised optimality embedding (outputs unchanged) and set its w."""
    policy.model.enable_optimality_condition()
    policy.config.model = policy.model.cfg
    if guidance is not None:
        policy.config.cfg_guidance = float(guidance)
    return policy


def collection_windows(adapter: PI0_CFG_Adapter, col: Collection) -> list[Window]:
    """Windows of every episode of the kept groups, labelled by its RLOO advantage."""
    return [w for g in col.groups for ep, a in zip(g.episodes, g.advantages) for w in adapter.episode_windows(ep, a)]


class RIPTTrainer:
    """Owns the adapter, optimizer and generator of one RL run (see module docstring)."""

    def __init__(self, policy: PI0Policy, runner: RolloutRunner, sampler: InitStateSampler, cfg: RLConfig,
                 eval_states: Sequence[tuple[int, int]] = (), history: InitStateHistory | None = None,
                 anchor_windows: Sequence[Window] = ()):
        self.policy, self.runner, self.cfg = policy, runner, cfg
        if cfg.anchor_ratio > 0 and not anchor_windows:
            raise ValueError("anchor_ratio > 0 needs anchor_windows (the warm start's demo windows)")
        if cfg.anchor_ratio > 0 and cfg.objective != "cfg":
            raise ValueError(f"the demo anchor (anchor_ratio > 0) is a CFG-objective option; objective={cfg.objective!r}")
        # demo windows (PI0_CFG_Adapter.demo_windows) for the anchor, labelled by their demo's outcome: a successful
        # demo is a positive (A = 1: a success in any group), a failed one (mixed-quality demos) trains the reference
        self.anchor_windows = [dict(w, label=float(w.get("success", 1.0)), advantage=float(w.get("success", 1.0)))
                               for w in anchor_windows]
        self.anchor_rng = np.random.default_rng(cfg.seed + 7)
        if cfg.objective == "ppo":
            self.adapter: PI0_CFG_Adapter = PI0_PPO_Adapter(policy, cfg.noise_level, cfg.clip)
        else:
            if not policy.config.model.optimality_condition:
                enable_optimality_condition(policy)
            policy.config.cfg_guidance = float(cfg.cfg_guidance)
            self.adapter = PI0_CFG_Adapter(policy, cfg.target, cfg.p_uncond, cfg.advantage_weighting,
                                           cfg.negative_weight)
        policy.model.set_trainable(cfg.trainable)  # before the optimizer collects the trainable parameters
        self.optimizer = RLOptimizerPI0_CFG(self.adapter, cfg.opt, seed=cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.behavior = policy
        self.gate_rng = np.random.default_rng(cfg.seed + 11)  # the refresh test's init states
        # sums per-rank counts (RLConfig.refresh_gate); train_loop.build_trainer sets an all-reduce over ranks
        self.stats_sum: Callable[[dict[str, float]], dict[str, float]] = dict
        if cfg.behavior == "frozen":  # a no-grad snapshot (same weights, w and norm stats), refreshed in step()
            self.behavior = copy.deepcopy(policy).eval()
            self.behavior.model.requires_grad_(False)
        collector = (SDEChunkPolicy(self.behavior, cfg.noise_level, self.generator) if cfg.objective == "ppo"
                     else Pi0ChunkPolicy(self.behavior, self.generator))
        self.rollouts = RolloutGenerator(runner, collector, sampler, cfg.group_size, cfg.dynamic_sampling, history,
                                         cfg.max_collect_attempts)
        self.replay = WindowReplay(cfg.replay_windows, cfg.seed + 13) if cfg.replay_windows > 0 else None
        self.eval_states = list(eval_states)
        self.iteration = 0
        self.curve: list[dict[str, float]] = []

    def evaluate(self, guidance: float | None = None, repeats: int | None = None) -> float:
        """Success rate on the held-out states (the policy's w unless ``guidance`` is given)."""
        old = self.policy.config.cfg_guidance
        if guidance is not None:
            self.policy.config.cfg_guidance = float(guidance)
        try:
            eps = self.runner.run(self.eval_states, group_size=repeats or self.cfg.eval_repeats,
                                  policy=Pi0ChunkPolicy(self.policy, torch.Generator().manual_seed(12345)))
        finally:
            self.policy.config.cfg_guidance = old
        return float(np.mean([e.success for e in eps]))

    @property
    def frozen_behavior(self) -> PI0Policy | None:
        """The no-grad rollout snapshot (``behavior="frozen"``), or None when the policy collects its own rollouts."""
        return None if self.behavior is self.policy else self.behavior

    def refresh_behavior(self) -> None:
        """Copy the trained weights (and w) into the frozen behaviour snapshot (``behavior="frozen"``)."""
        self.behavior.model.load_state_dict(self.policy.model.state_dict())
        self.behavior.config.cfg_guidance = self.policy.config.cfg_guidance

    def gate_refresh(self) -> dict[str, float]:
        """RLConfig.refresh_gate: paired rollouts of the trained policy and the snapshot on training states; the
        snapshot takes the trained weights only if they succeed more often -> ``behavior/*`` scalars."""
        pairs = self.rollouts.sampler.pairs
        n = self.cfg.refresh_gate
        states = [pairs[i] for i in self.gate_rng.choice(len(pairs), n, replace=n > len(pairs))]
        seed = self.cfg.seed * 100_003 + self.iteration  # the same flow noise for both policies
        wins = {name: float(sum(e.success for e in self.runner.run(
                    states, group_size=1, policy=Pi0ChunkPolicy(pol, torch.Generator().manual_seed(seed)))))
                for name, pol in (("candidate", self.policy), ("snapshot", self.behavior))}
        tot = self.stats_sum({**wins, "n": float(n)})
        accepted = tot["candidate"] > tot["snapshot"]
        if accepted:
            self.refresh_behavior()
        return {"behavior/candidate_success": tot["candidate"] / tot["n"],
                "behavior/snapshot_success": tot["snapshot"] / tot["n"], "behavior/refreshed": float(accepted)}

    def step(self) -> dict[str, float]:
        """One iteration: collect, advantages, update (+ eval); returns and logs its scalars."""
        cfg = self.cfg
        self.policy.eval()
        col = self.rollouts.collect(cfg.num_groups)
        windows = collection_windows(self.adapter, col)
        if cfg.objective == "cfg" and cfg.negative_weight == 0.0:  # weight-0 windows add nothing: spare their passes
            windows = [w for w in windows if w["label"] > 0]
        n_fresh = len(windows)
        if self.replay is not None:
            self.replay.add(windows)
            windows = self.replay.sample(min(cfg.replay_sample or n_fresh, len(self.replay)))
        n_anchor = round(cfg.anchor_ratio * len(windows)) if self.anchor_windows else 0
        if n_anchor:
            pool = len(self.anchor_windows)
            idx = self.anchor_rng.choice(pool, n_anchor, replace=n_anchor > pool)
            windows = windows + [self.anchor_windows[i] for i in idx]
        if not cfg.train_on_rollouts:
            windows = windows[len(windows) - n_anchor:]
        upd = self.optimizer.step(windows)  # also with no windows: a distributed optimizer must join collectives
        self.iteration += 1
        gate: dict[str, float] = {}
        if self.frozen_behavior is not None and cfg.behavior_refresh and self.iteration % cfg.behavior_refresh == 0:
            if cfg.refresh_gate:
                gate = self.gate_refresh()
            else:
                self.refresh_behavior()
        adv = np.concatenate([g.advantages for g in col.groups]) if col.groups else np.zeros(1)
        st = {"rollout/success_rate": col.success_rate, "rollout/frac_groups_kept": col.frac_kept,
              "rollout/groups": float(col.num_groups), "rollout/skipped_states": float(col.num_skipped_states),
              "time/rollout_s": col.rollout_time, "time/update_s": upd["update_time"],
              "adv/mean": float(adv.mean()), "adv/std": float(adv.std()), "adv/max": float(adv.max()),
              "adv/min": float(adv.min()), "train/windows": float(len(windows)),
              "train/frac_positive": float(np.mean([w["label"] for w in windows])) if windows else 0.0,
              "train/anchor_windows": float(n_anchor),
              "train/replay_windows": float(len(self.replay) if self.replay is not None else 0)}
        st.update({f"train/{k}": v for k, v in upd.items() if k != "update_time"})
        st.update(gate)
        if cfg.eval_every and self.eval_states and self.iteration % cfg.eval_every == 0:
            t0 = time.perf_counter()
            st["eval/success_rate"] = self.evaluate()
            st["time/eval_s"] = time.perf_counter() - t0
        if col.exhausted:
            print(f"[ript] iteration {self.iteration}: {col.exhausted}", flush=True)
        st["iteration"] = float(self.iteration)
        self.curve.append(st)
        self.last_collection = col
        return st

    def train(self, iterations: int, seconds: float | None = None,
              callback: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """Run ``iterations`` iterations (or stop once ``seconds`` of wall-clock are used)."""
        t0 = time.perf_counter()
        for _ in range(iterations):
            st = self.step()
            if callback is not None:
                callback(st)
            if seconds is not None and time.perf_counter() - t0 >= seconds:
                break
        return self.curve
