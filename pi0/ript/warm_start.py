"""Tiny arena pi0 + supervised warm start (SFT) on a small fixed set of scripted-expert demos, and evaluation.

SFT is pi0's flow-matching loss on expert chunks (``FlowMatchingObjective``), run by the same ``PolicyUpdate`` as
RL. The warm start trains until held-out-validation success stops improving (:class:`Plateau`) and keeps the best
weights: a *converged* few-shot start, so that what RL adds is not unfinished SFT; it can train data parallel over
spawned gloo ranks (:func:`sft_to_plateau_parallel`). Demos and the warm-started checkpoint are cached on disk by
config hash. RFT (SFT on the demos plus the policy's own successes) is :func:`rft`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pi0.errors import UserError
from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.pi0 import PI0Policy, PolicyConfig
from pi0.policies.normalize import NormStats, Stats
from pi0.policies.presets import default_cache_dir, tiny_tokenizer
from pi0.envs import make_env_spec
from pi0.envs.metaworld_env import RENDER_TAG
from pi0.rollout import Episode, RolloutRunner, RunnerConfig
from pi0.rollout.policies import collect_expert_demos
from pi0.ript.collection import Collection, RolloutGenerator, rl_collector
from pi0.ript.init_states import InitStateSampler
from pi0.ript.objectives import FlowMatchingObjective, Window
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.utils.dist_utils import DistInfo, spawn_gloo
from pi0.transforms import libero_client_obs


@dataclass
class TinyArenaConfig:
    """A tiny pi0 for the arena (same architecture as pi0, small sizes)."""

    image_size: int = 56  # SigLIP input (multiple of patch_size); the client resize follows it
    patch_size: int = 14
    vision_width: int = 32  # SigLIP width (mu: 32, 1 layer)
    depth: int = 2  # Gemma layers of both experts
    width: int = 64
    action_horizon: int = 10
    n_action_steps: int = 5
    num_steps: int = 5  # Euler steps
    max_token_len: int = 24  # arena prompts are <= 23 tiny-tokenizer tokens
    init: str = "scratch"  # PI0Policy.random_init mode: "scratch" trains; "noisy" (parity init) barely sees images
    seed: int = 0
    pi05: bool = False  # the pi0.5 architecture (no state token; adaRMS time conditioning)


def tiny_arena_policy(cfg: TinyArenaConfig, norm_stats: NormStats) -> PI0Policy:
    """A randomly initialised tiny pi0 (2 cameras, 8-D state, 7-D actions, absolute arena actions)."""
    g = GemmaConfig(cfg.width, cfg.depth, 2 * cfg.width, 4, 1, 16)
    vis = SiglipConfig(cfg.vision_width, 1, 4 * cfg.vision_width, 2, patch_size=cfg.patch_size,
                       image_size=cfg.image_size, variant="custom")
    mc = Pi0Config(paligemma=g, action_expert=g, vision=vis,
                   vocab_size=1024, action_horizon=cfg.action_horizon, num_cameras=2,
                   max_token_len=cfg.max_token_len, pi05=cfg.pi05)
    pc = PolicyConfig(model=mc, n_action_steps=cfg.n_action_steps, num_steps=cfg.num_steps, delta_action_dims=0,
                      image_keys=("base_0_rgb", "left_wrist_0_rgb"))
    return PI0Policy.random_init(pc, norm_stats, tiny_tokenizer(cfg.max_token_len), seed=cfg.seed,
                                init=cfg.init).eval()


def arena_runner(num_envs: int, replan_steps: int, resolution: int = 64, max_steps: int | None = None,
                 num_init_states: int = 200) -> RolloutRunner:
    """In-process arena runner (the arena is cheap; one process keeps the policy batches large)."""
    spec = make_env_spec("arena", resolution=resolution, num_init_states=num_init_states)
    return RolloutRunner(spec, None, RunnerConfig(num_envs=num_envs, replan_steps=replan_steps, use_subprocess=False,
                                                  max_steps=max_steps))


ENVS = ("arena", "metaworld")


def env_runner(env: str, num_envs: int, replan_steps: int, resolution: int = 64, max_steps: int | None = None,
               num_init_states: int = 200, expert_horizon: int = 0, envs_per_worker: int = 1,
               overlap: bool = False) -> RolloutRunner:
    """The runner of a benchmark env: the arena in process (cheap; keeps the policy batches large), MetaWorld in
    subprocess workers (MuJoCo), ``envs_per_worker`` envs in each (one message per worker and round, so few
    processes serve large policy batches; ``overlap``: ``RunnerConfig.overlap``). ``expert_horizon`` > 0: MetaWorld
    observations carry the expert's chunks."""
    if env == "arena":
        return arena_runner(num_envs, replan_steps, resolution, max_steps, num_init_states)
    if env != "metaworld":
        raise ValueError(f"env must be one of {ENVS}, got {env!r}")
    import os
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    extra = {"expert_chunks": True, "expert_horizon": expert_horizon} if expert_horizon else {}
    spec = make_env_spec("metaworld", resolution=resolution, num_init_states=num_init_states, **extra)
    return RolloutRunner(spec, None, RunnerConfig(num_envs=num_envs, replan_steps=replan_steps, max_steps=max_steps,
                                                  envs_per_worker=min(envs_per_worker, num_envs), overlap=overlap))


def expert_demos(env: str, demo_states: Sequence[tuple[int, int]], horizon: int, replan_steps: int,
                 resolution: int = 64, seed: int = 0) -> list[tuple[Episode, np.ndarray]]:
    """Scripted-expert episodes on ``demo_states`` + the expert chunks (D, H, 7) at their decision points."""
    if env == "arena":
        return arena_expert_demos(demo_states, horizon, replan_steps, resolution, seed=seed)
    from pi0.rollout.policies import collect_metaworld_demos
    with env_runner(env, 2, replan_steps, resolution, num_init_states=init_states_for(demo_states),
                    expert_horizon=horizon) as runner:
        return collect_metaworld_demos(runner, list(demo_states), horizon)


def init_states_for(states: Sequence[tuple[int, int]]) -> int:
    """Arena init states a runner needs to serve ``states`` (at least the default 200)."""
    return max(200, 1 + max(i for _, i in states))


def arena_expert_demos(demo_states: Sequence[tuple[int, int]], horizon: int, replan_steps: int, resolution: int = 64,
                       noise: float = 0.0, seed: int = 0, aim_error: float = 0.0) -> list[tuple[Episode, np.ndarray]]:
    """:func:`collect_expert_demos` on ``demo_states`` through an in-process arena runner sized to them."""
    with arena_runner(8, replan_steps, resolution, num_init_states=init_states_for(demo_states)) as runner:
        return collect_expert_demos(runner, demo_states, horizon, noise, seed, aim_error)


def demo_windows(policy: PI0Policy, demos: Sequence[tuple[Episode, np.ndarray]]) -> list[Window]:
    """Expert demos (episode, chunks (D, H, 7)) -> SFT windows of ``policy`` (the expert's chunks as targets)."""
    objective = FlowMatchingObjective(policy)
    return [w for e, chunks in demos for w in objective.demo_windows(e, chunks)]


def demo_norm_stats(demos: Sequence[tuple[Episode, np.ndarray]]) -> NormStats:
    """z-score / quantile stats of the client state (8,) and the expert actions (7,) of the demos."""
    states = np.stack([libero_client_obs(d.obs, 16)["state"] for e, _ in demos for d in e.decisions])
    acts = np.concatenate([c.reshape(-1, c.shape[-1]) for _, c in demos])

    def st(x: np.ndarray, floor: float) -> Stats:
        # a std floor keeps near-constant dims (the demo gripper orientation) from blowing up off-distribution
        return Stats(x.mean(0), np.maximum(x.std(0), floor), np.quantile(x, 0.01, 0), np.quantile(x, 0.99, 0))
    return {"state": st(states, 0.1), "actions": st(acts, 0.05)}


def evaluate_episodes(runner: RolloutRunner, policy: PI0Policy, states: Sequence[tuple[int, int]],
                      repeats: int = 1, seed: int = 0, guidance: float | None = None) -> np.ndarray:
    """Success (0/1) of ``policy`` on each of ``states`` x ``repeats``, in request order ``(len(states) * repeats,)``.

    Each episode's initial noise is keyed to (seed, task, init state, repeat, decision)
    (:func:`pi0.policies.libero.episode_noise`), so two policies evaluated with one seed see the same noise per
    episode whatever the batching: their per-episode differences are paired. ``guidance`` temporarily overrides w."""
    old = policy.config.cfg_guidance
    if guidance is not None:
        policy.config.cfg_guidance = float(guidance)
    try:
        eps = runner.run(list(states), group_size=repeats, policy=Pi0ChunkPolicy(
            policy, torch.Generator().manual_seed(seed), episode_seed=seed))
    finally:
        policy.config.cfg_guidance = old
    return np.array([float(e.success) for e in eps])


def evaluate(runner: RolloutRunner, policy: PI0Policy, states: Sequence[tuple[int, int]], repeats: int = 1,
             seed: int = 0, guidance: float | None = None) -> float:
    """Success rate of ``policy`` on ``states`` x ``repeats`` (:func:`evaluate_episodes`, averaged)."""
    return float(np.mean(evaluate_episodes(runner, policy, states, repeats, seed, guidance)))


def sft(policy: PI0Policy, windows: Sequence[Window], opt_cfg: OptimizerConfig, steps: int | None = None,
        seconds: float | None = None, seed: int = 0, update: PolicyUpdate | None = None,
        info: DistInfo | None = None) -> PolicyUpdate:
    """Flow-matching SFT on ``windows`` for ``steps`` optimizer steps or ``seconds`` of wall-clock (``info``: this
    rank's shard of a data-parallel group; every rank must call it with the same ``steps``)."""
    upd = update or PolicyUpdate(FlowMatchingObjective(policy), opt_cfg, seed=seed, info=info)
    t0, done = time.perf_counter(), 0
    while (steps is None or done < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
        st = upd.step(windows, max_steps=1 if seconds is not None else (steps - done))
        done += int(st["steps"] + st["skipped_steps"])
    policy.eval()
    return upd


def cool_down(policy: PI0Policy, windows: Sequence[Window], opt_cfg: OptimizerConfig, steps: int,
              seed: int = 0) -> None:
    """The start's last phase: ``steps`` SFT steps from its plateau weights with the step size decayed linearly from
    ``opt_cfg.lr`` to 0 (a fresh AdamW, warmed up over the first 5% of the steps).

    SFT at a constant step size ends on a noisy iterate: make run's start (lr 2e-3) scored 0.29-0.45 on validation
    from one check to the next. Over 3 such starts, 1,000 cooldown steps raised validation success from 0.341 to
    0.415 on average, and continued SFT at the baseline arm's step size gained nothing after them
    (``bench/start_cooldown.py``), so a later arm's gain over the start is not the annealing the start skipped."""
    # as in the decay phase of a warmup-stable-decay schedule (Hu et al. 2024, MiniCPM, arXiv 2404.06395)
    upd = PolicyUpdate(FlowMatchingObjective(policy), replace(opt_cfg, warmup_steps=max(1, steps // 20)), seed=seed)
    for i in range(steps):
        upd.lr_scale = 1.0 - i / steps  # times the warm-up's ramp: the last step's lr is opt_cfg.lr / steps
        upd.step(windows, max_steps=1)
    policy.eval()


@dataclass
class Plateau:
    """Train SFT until held-out-validation success stops improving: evaluated every ``every`` steps (one rollout per
    state of ``val_states``), stopped after ``patience`` evaluations without a gain of more than ``min_delta`` over the
    best, and the best weights are kept. The validation states must be disjoint from those a bench evaluates on.

    ``smooth`` > 1: the criterion is the mean of the last ``smooth`` checks (a lucky noisy check does not become the
    start; the weights kept are those of the last check of the best window). ``require_convergence``: reaching the
    step cap before patience ran out is an error (the start would not be converged by its own rule).
    ``patience_from_success``: patience counts only once the criterion has been above 0. A policy that has not yet
    succeeded has nothing to plateau at: early checks sit at 0 for a while, and a slow start would stop there with a
    plateau of 0. A run that succeeds at some check trains to the same weights either way."""

    val_states: list[tuple[int, int]]
    every: int = 250
    patience: int = 4
    min_delta: float = 0.0
    smooth: int = 1
    require_convergence: bool = False
    patience_from_success: bool = False

    def key_fields(self) -> dict:
        """The fields that name a cached start (the later ones only when set: older caches keep their keys).
        ``patience_from_success`` never does: it changes only starts whose plateau is 0, and such a start trained
        without it is not reused under it (:meth:`reuses`)."""
        d = asdict(self)
        d.pop("patience_from_success")
        for name, default in (("smooth", 1), ("require_convergence", False)):
            if d[name] == default:
                d.pop(name)
        return d

    def reuses(self, record: dict) -> bool:
        """Whether a cached start's ``warm_start.json`` record is what this rule trains: under
        ``patience_from_success``, a plateau of 0 trained without it (a run stopped on patience before it ever
        succeeded) is not."""
        return (not self.patience_from_success or (record.get("plateau") or 0.0) > 0.0
                or (record.get("stop") or {}).get("patience_from_success", False))


def warm_start_key(cfg: TinyArenaConfig, demo_states: Sequence[tuple[int, int]], sft_steps: int | None,
                   opt_cfg: OptimizerConfig, stop: Plateau | None = None, env: str = "arena", procs: int = 1) -> str:
    """Cache key of a warm-started checkpoint (``sft_steps=None``: the key of a start converged by ``stop``, which
    any step cap at or above the step it stopped at reproduces; ``procs`` > 1: trained data parallel)."""
    # no value head in SFT, and no warm-up unless set: neither is in the key (older caches keep their keys)
    opt = {k: v for k, v in asdict(opt_cfg).items() if k != "value_lr" and not (k == "warmup_steps" and v == 0)}
    blob = json.dumps([asdict(cfg), [list(s) for s in demo_states], sft_steps, opt,
                       stop.key_fields() if stop else None, "v2-all-dims"] + ([env] if env != "arena" else [])
                      + ([RENDER_TAG] if env == "metaworld" else [])
                      + ([{"procs": procs}] if procs > 1 else []), sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def validation_success(runner: RolloutRunner, policy: PI0Policy, states: Sequence[tuple[int, int]], seed: int = 0,
                       info: DistInfo | None = None) -> float:
    """Success rate on ``states`` (:func:`evaluate`); with a data-parallel ``info`` each rank rolls out its
    ``states[rank::world]`` and the counts are summed, which gives the single-process figure (per-episode noise)."""
    if info is None or not info.enabled:
        return evaluate(runner, policy, states, seed=seed)
    mine = list(states)[info.rank::info.world_size]
    succ = evaluate_episodes(runner, policy, mine, seed=seed) if mine else np.zeros(0)
    counts = torch.tensor([float(succ.sum()), float(len(succ))], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def sft_to_plateau(policy: PI0Policy, windows: Sequence[Window], opt_cfg: OptimizerConfig, max_steps: int,
                   stop: Plateau, runner: RolloutRunner, seed: int = 0, log: bool = True,
                   info: DistInfo | None = None, resume: Path | None = None) -> list[dict[str, float]]:
    """SFT until ``stop`` says validation success plateaued (or ``max_steps``: an error with
    ``stop.require_convergence``); loads the best weights into ``policy`` -> the validation curve [{steps,
    val_success, val_smoothed, seconds}].

    ``info``: data parallel. Each rank passes its shard of the windows and a per-rank minibatch; the gradients are
    averaged over ranks (``PolicyUpdate``), the validation counts summed (:func:`validation_success`), so every rank
    takes the same decisions and ends with the same weights.

    ``resume`` (one process): after every check the run's whole state (weights, AdamW and RNG states, the curve, the
    best weights, the patience count) is written there, and a call that finds the file continues from it, so a run
    stopped by the step cap (or killed) goes on under a higher cap to exactly the weights and curve one
    uninterrupted run would give. The caller names the file by everything but the cap and deletes it when done."""
    import copy

    upd, done, curve, t0 = None, 0, [], time.perf_counter()
    best, best_state, since = -1.0, None, 0
    k = max(1, int(stop.smooth))
    update_seed = seed + 1000 * info.rank if info is not None else seed  # flow noise / minibatch order per rank
    if resume is not None and info is not None and info.enabled:
        raise ValueError("sft_to_plateau: resume is for one process (the data-parallel start does not resume)")
    st = torch.load(resume, weights_only=True) if resume is not None and resume.is_file() else None
    if st is not None and st["done"] <= max_steps:  # (a run past this cap is not what this cap trains)
        policy.model.load_state_dict(st["model"])
        upd = PolicyUpdate(FlowMatchingObjective(policy), opt_cfg, seed=update_seed)
        upd.load_state_dict(st["update"])
        done, curve, best, best_state, since = st["done"], st["curve"], st["best"], st["best_state"], st["since"]
        if stop.patience_from_success and best <= 0.0:
            since = 0  # (a partial written without the rule counted the checks at 0)
        t0 -= curve[-1]["seconds"] if curve else 0.0
        if log:
            print(f"warm start: resumed at {done} SFT steps from {resume}", flush=True)
    while done < max_steps and not (curve and since >= stop.patience):
        n = min(stop.every, max_steps - done)
        upd = sft(policy, windows, opt_cfg, steps=n, seed=update_seed, update=upd, info=info)
        done += n
        val = validation_success(runner, policy, stop.val_states, seed, info)
        # the mean of the last k checks, once there are k (an early lucky check cannot become the start)
        window = [c["val_success"] for c in curve[len(curve) - k + 1:]] + [val] if k > 1 else [val]
        smoothed = float(np.mean(window)) if len(window) == k else None
        curve.append({"steps": done, "val_success": val, "val_smoothed": smoothed,
                      "seconds": time.perf_counter() - t0})
        if log:
            print(f"warm start: {done} SFT steps, validation success {val:.3f}"
                  + (f" (mean of the last {k}: {smoothed:.3f})" if k > 1 and smoothed is not None else "")
                  + f" (best {max(best, smoothed if smoothed is not None else -1.0):.3f})", flush=True)
        if smoothed is not None:
            if smoothed > best + stop.min_delta:
                best, best_state, since = smoothed, copy.deepcopy(policy.model.state_dict()), 0
            elif best > 0.0 or not stop.patience_from_success:
                since += 1
        if resume is not None:  # written whole, then renamed: a kill leaves the last complete check
            tmp = resume.with_name(resume.name + ".tmp")
            torch.save({"model": policy.model.state_dict(), "update": upd.state_dict(), "done": done, "curve": curve,
                        "best": best, "best_state": best_state, "since": since}, tmp)
            tmp.replace(resume)
        if since >= stop.patience:
            break
    else:
        if stop.require_convergence and stop.patience_from_success and best <= 0.0:
            raise UserError(f"the SFT start never succeeded on its {len(stop.val_states)} validation states in "
                            f"{max_steps} steps; raise the cap (--sft_steps, task.warm_start_steps) or the demos"
                            + (f"; it resumes at step {done}" if resume else ""))
        if stop.require_convergence and since < stop.patience:
            raise UserError(f"the SFT start did not converge: the step cap {max_steps} came after {since} of "
                            f"{stop.patience} patience checks without a gain; raise the cap (--sft_steps, "
                            f"task.warm_start_steps)" + (f" and the start resumes at step {done}" if resume else ""))
    if best_state is not None:
        policy.model.load_state_dict(best_state)
    policy.eval()
    return curve


def converged_start(cache: Path, converged_key: str, sft_steps: int, stop: Plateau) -> Path | None:
    """A cached start that converged by the same rule (``stop``) on the same data and settings under another step
    cap, and stopped at or before ``sft_steps`` (so this cap would have trained the same weights), else None."""
    for rec_path in sorted(cache.glob("*/warm_start.json")):
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("converged_key") == converged_key and rec.get("stopped_at", sft_steps + 1) <= sft_steps \
                and stop.reuses(rec) and (rec_path.parent / "model.safetensors").is_file():
            return rec_path.parent
    return None


def validation_runner(env: str, val_states: Sequence[tuple[int, int]], episodes: int, replan_steps: int,
                      resolution: int) -> RolloutRunner:
    """The runner of the start's validation checks: up to 50 arena envs in process or 4 MetaWorld workers, for
    ``episodes`` rollouts at a time, over init states that cover ``val_states``."""
    return env_runner(env, min(50 if env == "arena" else 4, episodes), replan_steps, resolution,
                      num_init_states=init_states_for(val_states))


def check_procs(opt_cfg: OptimizerConfig, procs: int) -> None:
    """A data-parallel start splits its minibatch evenly among its processes (one-line error otherwise)."""
    if procs < 1 or opt_cfg.minibatch_size % procs:
        raise UserError(f"the start's minibatch ({opt_cfg.minibatch_size}) must divide among its {procs} processes "
                        f"(task.warm_start_minibatch, task.warm_start_procs)")


def _plateau_rank(info: DistInfo, cfg: TinyArenaConfig, policy: PI0Policy, windows: list[Window],
                  opt_cfg: OptimizerConfig, max_steps: int, stop: Plateau, env: str, resolution: int) -> dict:
    """One rank of a data-parallel :func:`sft_to_plateau`: its shard of the windows, its share of the minibatch and
    of the validation states -> the best weights and the curve (or the not-converged error)."""
    rank, procs = info.rank, info.world_size
    mine = stop.val_states[rank::procs]
    with validation_runner(env, stop.val_states, len(mine), cfg.n_action_steps, resolution) as runner:
        try:
            curve = sft_to_plateau(policy, windows[rank::procs], replace(
                opt_cfg, minibatch_size=opt_cfg.minibatch_size // procs), max_steps, stop, runner, seed=cfg.seed,
                log=rank == 0, info=info)
        except UserError as e:  # every rank took the same decisions: rank 0 reports it
            return {"error": str(e)}
    return {"curve": curve, "state": policy.model.state_dict()}


def sft_to_plateau_parallel(cfg: TinyArenaConfig, policy: PI0Policy, windows: Sequence[Window],
                            opt_cfg: OptimizerConfig, max_steps: int, stop: Plateau, procs: int, env: str = "arena",
                            resolution: int = 64) -> list[dict[str, float]]:
    """:func:`sft_to_plateau` data parallel over ``procs`` spawned processes (one thread each): the same rule and
    the same global minibatch (``opt_cfg.minibatch_size``, split among the ranks). On 2 cores a step of the tiny
    policy runs 1.10-1.17x faster as 2 ranks than in one process with 2 threads (``bench/parallel_start.py``).
    Loads the best weights into ``policy`` -> the validation curve."""
    check_procs(opt_cfg, procs)
    result = spawn_gloo(_plateau_rank, procs, cfg, policy, list(windows), opt_cfg, max_steps, stop, env, resolution)
    if "error" in result:
        raise UserError(result["error"])
    policy.model.load_state_dict(result["state"])
    policy.eval()
    return result["curve"]


def cached_warm_start(cfg: TinyArenaConfig, demo_states: Sequence[tuple[int, int]], sft_steps: int,
                      opt_cfg: OptimizerConfig, cache_dir: Path | None = None, resolution: int = 64,
                      stop: Plateau | None = None, env: str = "arena",
                      procs: int = 1, cooldown: int = 0) -> tuple[PI0Policy, list[Window], Path]:
    """SFT'd tiny policy + its demo windows, computed once and cached under ``<cache>/ript_warm_start/<key>``.

    ``sft_steps`` SFT steps, or (with ``stop``) until validation success plateaus, at most ``sft_steps``;
    ``<key>/warm_start.json`` records the validation curve, the steps and the plateau (best validation success).
    ``procs`` > 1 (with ``stop``): trained data parallel (:func:`sft_to_plateau_parallel`), a start of its own key.
    ``cooldown`` > 0: that start, then :func:`cool_down` over this many steps, cached as ``<key>-cool<n>`` (its record
    adds ``val_after_cooldown``, the plateau's validation check of the cooled weights).
    """
    procs = procs if stop is not None else 1
    check_procs(opt_cfg, procs)
    if cooldown < 0:
        raise UserError(f"the start's cooldown must be >= 0 steps (task.warm_start_cooldown), got {cooldown}")
    cache = (cache_dir or default_cache_dir()) / "ript_warm_start"
    root = cache / warm_start_key(cfg, demo_states, sft_steps, opt_cfg, stop, env, procs)
    converged_key = warm_start_key(cfg, demo_states, None, opt_cfg, stop, env, procs) \
        if stop and stop.require_convergence else None
    if converged_key and not _reusable(root, stop):
        root = converged_start(cache, converged_key, sft_steps, stop) or root
    if cooldown:  # named by the start it cools: a start reused under a higher cap is cooled once
        cooled = root.with_name(f"{root.name}-cool{cooldown}")
        if not _reusable(cooled, stop):
            policy, windows, base = cached_warm_start(cfg, demo_states, sft_steps, opt_cfg, cache_dir, resolution,
                                                      stop, env, procs)
            rec = json.loads((base / "warm_start.json").read_text())
            t0 = time.perf_counter()
            cool_down(policy, windows, opt_cfg, cooldown, seed=cfg.seed)
            val = None
            if stop is not None:  # the same check as the plateau's (one rollout per validation state, seed)
                with validation_runner(env, stop.val_states, len(stop.val_states), cfg.n_action_steps,
                                       resolution) as val_runner:
                    val = validation_success(val_runner, policy, stop.val_states, cfg.seed)
                print(f"warm start: cooled down over {cooldown} SFT steps, validation success {val:.3f}", flush=True)
            rec.update(cooldown=cooldown, base=base.name, val_after_cooldown=val,
                       cooldown_seconds=time.perf_counter() - t0)
            _store(policy, rec, cooled)
            return policy, windows, cooled
        root = cooled
    torch.manual_seed(cfg.seed)
    demos = expert_demos(env, demo_states, cfg.action_horizon, cfg.n_action_steps, resolution, seed=cfg.seed)
    if _reusable(root, stop):
        policy = PI0Policy.from_pretrained(root)
        return policy, demo_windows(policy, demos), root
    policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
    windows = demo_windows(policy, demos)
    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    if stop is None:
        sft(policy, windows, opt_cfg, steps=sft_steps, seed=cfg.seed)
    elif procs > 1:
        curve = sft_to_plateau_parallel(cfg, policy, windows, opt_cfg, sft_steps, stop, procs, env, resolution)
    else:
        # named by everything but the cap: a run stopped by the cap (or killed) resumes under a higher one
        partial = cache / f"{warm_start_key(cfg, demo_states, None, opt_cfg, stop, env, procs)}.partial.pt"
        cache.mkdir(parents=True, exist_ok=True)
        with validation_runner(env, stop.val_states, len(stop.val_states), cfg.n_action_steps,
                               resolution) as val_runner:
            curve = sft_to_plateau(policy, windows, opt_cfg, sft_steps, stop, val_runner, seed=cfg.seed,
                                   resume=partial)
    full = [c for c in curve if c["val_smoothed"] is not None]
    best = max(full, key=lambda c: c["val_smoothed"]) if full else None
    _store(policy, {
        "config": asdict(cfg), "env": env, "demos": len(demo_states), "sft_steps_max": sft_steps,
        "stop": asdict(stop) if stop else None, "curve": curve, "seconds": time.perf_counter() - t0,
        "converged_key": converged_key, "stopped_at": curve[-1]["steps"] if curve else sft_steps, "procs": procs,
        "steps": best["steps"] if best else sft_steps, "plateau": best["val_smoothed"] if best else None}, root)
    if stop is not None and procs == 1:
        partial.unlink(missing_ok=True)
    return policy, windows, root


def _reusable(root: Path, stop: Plateau | None) -> bool:
    """Whether ``root`` holds a cached start that ``stop`` trains (:meth:`Plateau.reuses`); one it does not (a plateau
    of 0 trained without ``patience_from_success``, or a start cooled from one) is deleted, to be retrained."""
    if not (root / "model.safetensors").is_file():
        return False
    if stop is None or stop.reuses(json.loads((root / "warm_start.json").read_text())):
        return True
    shutil.rmtree(root)
    return False


def _store(policy: PI0Policy, record: dict, root: Path) -> None:
    """Save a start and its ``warm_start.json`` record under ``root`` (written whole, then renamed)."""
    tmp = root.with_name(root.name + ".tmp")
    policy.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(record))
    tmp.rename(root)


def success_windows(objective: FlowMatchingObjective, col: Collection) -> list[Window]:
    """SFT windows of the successful rollouts of a collection (reward > 0), the chunks the policy sampled."""
    return [w for g in col.groups for ep, r in zip(g.episodes, g.rewards) if r > 0
            for w in objective.episode_windows(ep, 0.0)]


def rft(policy: PI0Policy, demo_windows: Sequence[Window], runner: RolloutRunner, sampler: InitStateSampler,
        opt_cfg: OptimizerConfig, seconds: float, num_groups: int = 4, group_size: int = 8, noise_level: float = 1.0,
        steps_per_iteration: int = 8, seed: int = 0, callback: Callable[[dict], None] | None = None,
        sde_step: int = 0, fast_sampling: bool = True, update: PolicyUpdate | None = None,
        sde_kind: str = "flow_sde", rl_objective: str = "ppo") -> PolicyUpdate:
    """Rejection-sampling fine-tuning (RFT) for ``seconds`` of wall-clock: each iteration collects K rollouts from
    each of B init states as the RL objective ``rl_objective`` does (the same collector,
    ``collection.rl_collector``: ppo's Flow-SDE with ``noise_level``, ``sde_step``, ``sde_kind`` as ``RLConfig``, or
    the deterministic sampler), adds the successful ones' windows to the demo windows, and takes
    ``steps_per_iteration`` SFT steps on minibatches drawn from the pool. No negatives, no condition, no new
    demos. ``callback`` gets the iteration's scalars and its ``Collection`` under "collection"; ``update`` continues
    a caller's ``PolicyUpdate`` (its optimizer state and schedule) instead of a fresh one of ``opt_cfg``."""
    upd = update or PolicyUpdate(FlowMatchingObjective(policy), opt_cfg, seed=seed)
    objective = upd.objective
    policy.model.enable_fast_sampling(fast_sampling)
    collector = rl_collector(policy, rl_objective, noise_level, sde_step, torch.Generator().manual_seed(seed), sde_kind)
    gen = RolloutGenerator(runner, collector, sampler, group_size, dynamic_sampling=False, max_attempts=1)
    pool = list(demo_windows)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        policy.eval()
        col = gen.collect(num_groups)
        new = success_windows(objective, col)
        pool += new
        st = upd.step(pool, max_steps=steps_per_iteration)
        if callback is not None:
            callback({"rollout/success_rate": col.success_rate, "rft/new_windows": float(len(new)),
                      "rft/pool": float(len(pool)), **{f"train/{k}": v for k, v in st.items()}, "collection": col})
    policy.eval()
    return upd
