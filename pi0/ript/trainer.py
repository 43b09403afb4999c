"""The RL recipe: one RIPT iteration, top-down (stages 7-11 run it through ``pi0.ript.utils.train_loop``; the bench
runs it directly).

    collect    K rollouts from each of B sampled init states with the behaviour policy (the current weights; for PPO
               the Flow-SDE sampler, recording each decision's denoising chain and log-density)   -> collection.py
    advantages RLOO within each group; dynamic sampling keeps the groups whose K rewards differ    -> algos/rloo.py
    windows    one training window per decision point of each kept episode, with its advantage   -> objectives.py
    update     epochs x minibatches of the objective (PPO-clipped LOOP, or CFGRL), ranks averaged -> update.py
               (``reuse_prefix``: PPO runs a frozen prefix on the kv caches collection's sampler computed)
    evaluate   held-out success with openpi's deterministic Euler sampler (every ``eval_every``)
    checkpoint ``state_dict()`` of the trainer: optimizer, RNGs, sampler, history (train_loop)   -> checkpoint.py

``algo.objective``: ``ppo`` (default; RIPT-VLA's LOOP with pi-RL's Flow-SDE likelihood) or ``cfg`` (CFGRL). What
trains: ``algo.trainable`` = ``all`` | ``expert`` (SigLIP and the VLM frozen, as pi-RL trains by default) | ``lora``.
``algo.fsdp`` shards ``all`` over the torchrun ranks with FSDP2 (``pi0.ript.utils.fsdp``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pi0.models.flow_sde import check_sde, sampler_step
from pi0.policies.pi0 import PI0Policy
from pi0.rollout import RolloutRunner
from pi0.ript.algos.rloo import episode_mean_advantages
from pi0.ript.collection import Collection, RolloutGenerator, release_prefixes, rl_collector
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.objectives import OBJECTIVES, CFGObjective, FlowMatchingObjective, PPOObjective, Window
from pi0.ript.update import DemoAnchor, OptimizerConfig, PolicyUpdate
from pi0.ript.utils.dist_utils import DistInfo
from pi0.ript.utils.fsdp import gathered, shard_model
from pi0.ript.warm_start import evaluate_episodes


@dataclass
class RLConfig:
    """RIPT settings: the ``algo`` section of the training config."""

    iterations: int = 10
    objective: str = "ppo"  # "ppo" | "cfg" (pi0.ript.objectives)
    trainable: str = "all"  # "all" | "expert" | "lora" (PI0Model.set_trainable)
    checkpointing: bool = False  # recompute each transformer layer in backward (activation memory)
    precision: str = "float32"  # "float32" | "bf16" (bf16 weights and compute, float32 masters of what trains)
    fsdp: bool = False  # torchrun: shard parameters, gradients and optimizer state over the ranks (trainable=all)
    # ppo: Flow-SDE noise level a (pi0.models.flow_sde). At step 0 the step's std is a and its mean keeps the initial
    # noise scaled by about 1 - 1/N - a^2/2, so a = 1 puts most randomness where the log-density credits it
    # (bench/README.md, noise level)
    noise_level: float = 1.0
    # ppo: the stochastic denoising step. 0 (t = 1): its noise moves the chunk enough for the advantage to credit it;
    # -1 = drawn uniformly per decision batch, as RLinf (did not learn here: bench/README.md, RL improvement);
    # -2 = every step stochastic and the ratio of the whole chain's log-density (Flow-GRPO; flow_sde only)
    sde_step: int = 0
    # ppo: the stochastic step's transition. "flow_sde" (Flow-GRPO / RLinf); "cps": Coefficients-Preserving Sampling
    # (Flow-CPS), whose step keeps the deterministic chain's marginal coefficients, noise_level = its eta in (0, 1]
    sde_kind: str = "flow_sde"
    clip: float = 0.2  # ppo: ratio clip
    # each episode's windows share its advantage (A * mean length / its length, pi0.ript.algos.rloo.
    # episode_mean_advantages) instead of each window counting once, which weights the longer failed episodes more
    episode_mean: bool = False
    # > 0: every update minibatch adds demo_coef x pi0's flow-matching loss on as many of the demos (the trainer's
    # ``demos`` windows; pi0.ript.update.DemoAnchor, as DAPG's behaviour-cloning term)
    demo_coef: float = 0.0
    # ppo: a value head (pi0's state-token output, detached; lr opt.value_lr) moves each decision's RLOO baseline by
    # the value's change since the episode's first decision (pi0.ript.algos.rloo.value_baselined_advantages)
    value_baseline: bool = False
    num_groups: int = 4  # B init states per iteration
    group_size: int = 8  # K rollouts per init state (rloo_batch_size)
    p_uncond: float = 0.3  # cfg: condition dropout of positive windows
    cfg_guidance: float = 1.0  # cfg: w used to collect and evaluate
    dynamic_sampling: bool = True
    max_collect_attempts: int = 3  # collection rounds per iteration before giving up (bounded sampling)
    # dynamic sampling: a round starts ~oversample x the groups it expects to keep (every env of an iteration in
    # flight, at most the runner's num_envs // group_size groups), keeps the first informative ones in the sampler's
    # order and abandons the rest (collection.groups_to_start); 0 = sequential rounds of exactly the missing groups
    oversample: float = 1.0
    # collection and evaluation sample through FastSampler (the same numbers as eager within 1e-5, cached prefix,
    # fused heads; pi0.models.fast_sampler); False: the eager reference sampler
    fast_sampling: bool = True
    # ppo with a frozen prefix (trainable=expert): each decision keeps the prefix kv cache the sampler computed, and
    # the update runs the action expert on it instead of encoding the observation again (the same loss within
    # float32 rounding; tests/test_update_prefix_cache.py). Memory: depth x 2 x Tp x K x H per decision until the
    # update (full-size pi0 in bf16: ~10 MB, kept on the model's device); false: the update encodes it again
    reuse_prefix: bool = True
    eval_every: int = 1  # 0 = never
    eval_repeats: int = 1
    opt: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))  # RL steps are small (pi-RL, openpi)
    seed: int = 0


def enable_optimality_condition(policy: PI0Policy, guidance: float | None = None) -> PI0Policy:
    """Give ``policy`` the zero-initialised optimality embedding (outputs unchanged) and set its w."""
    policy.model.enable_optimality_condition()
    policy.config.model = policy.model.cfg
    if guidance is not None:
        policy.config.cfg_guidance = float(guidance)
    return policy


def collection_windows(objective: FlowMatchingObjective, col: Collection, episode_mean: bool = False
                       ) -> list[Window]:
    """Windows of every episode of the kept groups, each with its episode's RLOO advantage (``episode_mean``: scaled
    by mean length / the episode's length, so that each episode counts once: ``episode_mean_advantages``)."""
    eps = [(ep, float(a), float(r)) for g in col.groups for ep, a, r in zip(g.episodes, g.advantages, g.rewards)]
    if episode_mean and eps:
        scaled = episode_mean_advantages(np.array([a for _, a, _ in eps]),
                                         np.array([max(1, len(ep.decisions)) for ep, _, _ in eps]))
        eps = [(ep, float(a), r) for (ep, _, r), a in zip(eps, scaled)]
    return [w for ep, a, r in eps for w in objective.episode_windows(ep, a, r)]


def build_objective(policy: PI0Policy, cfg: RLConfig) -> FlowMatchingObjective:
    """The objective ``cfg.objective`` names (cfg: gives the policy its optimality condition and w)."""
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"algo.objective must be one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.objective == "ppo":
        if cfg.value_baseline:
            policy.model.enable_value_head()
            policy.config.model = policy.model.cfg
        check_sde(cfg.sde_kind, cfg.noise_level, sampler_step(cfg.sde_step),
                  policy.config.num_steps)
        return PPOObjective(policy, cfg.noise_level, cfg.clip, cfg.value_baseline, cfg.sde_kind)
    if cfg.value_baseline:
        raise ValueError("algo.value_baseline is a baseline of the ppo objective; set algo.value_baseline=false for "
                         "algo.objective=cfg")
    if not policy.config.model.optimality_condition:
        enable_optimality_condition(policy)
    policy.config.cfg_guidance = float(cfg.cfg_guidance)
    return CFGObjective(policy, cfg.p_uncond)


PRECISIONS = ("float32", "bf16")
EVAL_SEED = 12345  # the held-out evaluation's noise seed (keyed per episode: every policy scored with it is paired)


class RIPTTrainer:
    """One RL run: the objective, the update and the rollout generator it builds from ``cfg``; :meth:`step` is one
    iteration. Under torchrun, ``info`` makes the update average over ranks, ``counter`` (iteration -> shared counter
    or None) makes collection stop on the global group count, and ``stats_sum`` sums per-rank scalars. ``demos``:
    the supervised windows ``cfg.demo_coef`` anchors the update to."""

    def __init__(self, policy: PI0Policy, runner: RolloutRunner, sampler: InitStateSampler, cfg: RLConfig,
                 eval_states: Sequence[tuple[int, int]] = (), history: InitStateHistory | None = None,
                 info: DistInfo | None = None, counter: Callable[[int], Any] | None = None,
                 demos: Sequence[Window] = ()):
        self.policy, self.runner, self.cfg = policy, runner, cfg
        if cfg.demo_coef < 0 or (cfg.demo_coef > 0 and not demos):
            raise ValueError(f"algo.demo_coef={cfg.demo_coef} needs demo windows (the trainer's demos) and a value "
                             f">= 0; set algo.demo_coef=0")
        self.info = info or DistInfo()
        self.objective = build_objective(policy, cfg)
        if cfg.precision not in PRECISIONS:
            raise ValueError(f"algo.precision must be one of {PRECISIONS}, got {cfg.precision!r}")
        if cfg.fsdp and cfg.trainable != "all":
            raise ValueError(f"algo.fsdp shards trainable=all; trainable={cfg.trainable!r} fits one GPU unsharded "
                             f"(docs/rl.md: training memory); set algo.fsdp=false")
        if cfg.precision == "bf16" and not cfg.fsdp and policy.config.model.dtype != "bfloat16":
            # as openpi's training (float32 params, bf16 compute): the float32-stored norms and heads keep their
            # float32 values ("high"); rounding them is openpi's serving restore, not its training
            policy.model.set_dtype("bfloat16", bf16_precision="high")
        policy.model.set_trainable(cfg.trainable)  # before the update collects the trainable parameters
        policy.model.set_gradient_checkpointing(cfg.checkpointing)
        if cfg.fsdp:  # float32 shards (the masters); bf16 compute through FSDP2's mixed precision
            shard_model(policy.model, self.info, cfg.precision)
        policy.config.model = policy.model.cfg
        anchor = DemoAnchor(list(demos), cfg.demo_coef, cfg.opt.minibatch_size) if cfg.demo_coef > 0 else None
        self.update = PolicyUpdate(self.objective, cfg.opt, seed=cfg.seed, info=self.info, anchor=anchor)
        # the behaviour policy is the current weights; PPO's "old policy" is the log-density recorded at collection
        self.generator = torch.Generator().manual_seed(cfg.seed)  # collection noise
        collector = rl_collector(policy, cfg.objective, cfg.noise_level, cfg.sde_step, self.generator, cfg.sde_kind,
                                 record_prefix=cfg.reuse_prefix)
        if cfg.fast_sampling and not cfg.fsdp and policy.model.fast_sampler is None:
            policy.model.enable_fast_sampling()
        elif not cfg.fast_sampling or cfg.fsdp:  # FSDP2: eager sampling on the gathered weights
            policy.model.enable_fast_sampling(False)
        in_flight = max(cfg.num_groups, runner.config.num_envs // cfg.group_size)  # groups the runner can hold at once
        self.rollouts = RolloutGenerator(runner, collector, sampler, cfg.group_size, cfg.dynamic_sampling, history,
                                         cfg.max_collect_attempts, oversample=cfg.oversample, max_groups=in_flight)
        self.counter = counter
        self.eval_states = list(eval_states)
        self.iteration = 0
        self.curve: list[dict[str, float]] = []
        self.last_collection: Collection | None = None

    # the seed's names of the pieces
    @property
    def adapter(self) -> FlowMatchingObjective:
        return self.objective

    @property
    def optimizer(self) -> PolicyUpdate:
        return self.update

    def evaluate(self, guidance: float | None = None, repeats: int | None = None) -> float:
        """Success rate on the held-out states with the deterministic sampler (the policy's w unless ``guidance``)."""
        out = self.evaluate_outcomes(guidance=guidance, repeats=repeats)
        return float(np.mean(out)) if len(out) else 0.0

    def evaluate_outcomes(self, policy: PI0Policy | None = None, guidance: float | None = None,
                          repeats: int | None = None) -> np.ndarray:
        """Per-episode held-out success ``(states x repeats,)`` of ``policy`` (default: the trained one) with the
        evaluation seed: every policy scored here meets the same noise per episode (paired)."""
        policy = self.policy if policy is None else policy
        with gathered(policy.model):  # FSDP2: rank-local sampling on gathered weights (every rank calls this)
            if not self.eval_states:
                return np.zeros(0)
            return evaluate_episodes(self.runner, policy, self.eval_states, repeats or self.cfg.eval_repeats,
                                     seed=EVAL_SEED, guidance=guidance)

    def step(self) -> dict[str, float]:
        """One iteration (module docstring) -> its scalars."""
        cfg = self.cfg
        self.policy.eval()
        # 1-2. collect K rollouts per init state; RLOO advantages; keep the informative groups (globally counted)
        counter = self.counter(self.iteration + 1) if self.counter is not None else None
        with gathered(self.policy.model):  # FSDP2: every rank samples on its own with the gathered weights
            col = self.rollouts.collect(cfg.num_groups, counter, cfg.num_groups * self.info.world_size)
        # 3. one window per decision point of each kept episode, labelled with its episode's advantage
        windows = collection_windows(self.objective, col, cfg.episode_mean)
        # 4. the update (every rank joins, also with no windows); a frozen prefix runs on collection's caches
        upd = self.update.step(windows)
        release_prefixes([ep for g in col.groups for ep in g.episodes])
        self.iteration += 1
        adv = np.concatenate([g.advantages for g in col.groups]) if col.groups else np.zeros(1)
        st = {"rollout/success_rate": col.success_rate, "rollout/frac_groups_kept": col.frac_kept,
              "rollout/groups": float(col.num_groups), "rollout/skipped_states": float(col.num_skipped_states),
              "time/rollout_s": col.rollout_time, "time/update_s": upd["update_time"],
              "adv/mean": float(adv.mean()), "adv/std": float(adv.std()), "adv/max": float(adv.max()),
              "adv/min": float(adv.min()), "train/windows": float(len(windows)),
              "train/frac_positive": float(np.mean([w["label"] for w in windows])) if windows else 0.0}
        st.update({f"train/{k}": v for k, v in upd.items() if k != "update_time"})
        # 5. held-out evaluation with the deterministic sampler
        if cfg.eval_every and (self.eval_states or self.update.sharded) and self.iteration % cfg.eval_every == 0:
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

    # 6. checkpoint: everything the trainer owns that a resumed run needs (the weights are the policy's checkpoint)
    def state_dict(self) -> dict[str, Any]:
        """Iteration, curve, collection RNG, update (optimizer + RNGs), sampler position and history."""
        return {"iteration": self.iteration, "curve": self.curve, "generator": self.generator.get_state(),
                "update": self.update.state_dict(), "rollouts": self.rollouts.state_dict()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.iteration, self.curve = int(st["iteration"]), list(st["curve"])
        self.generator.set_state(st["generator"])
        self.update.load_state_dict(st["update"])
        self.rollouts.load_state_dict(st["rollouts"])
