"""Tiny arena pi0 + supervised warm start (SFT) on a small fixed set of scripted-expert demos, and evaluation.

SFT is pi0's ordinary flow-matching loss on expert chunks, run by the same ``RLOptimizerPI0_CFG`` as RL
(no advantages, no condition). The demos and the warm-started checkpoint are cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.pi0 import PI0Policy, PolicyConfig
from pi0.policies.normalize import NormStats, Stats
from pi0.policies.presets import default_cache_dir, tiny_tokenizer
from pi0.envs import make_env_spec
from pi0.rollout import Episode, RolloutRunner, RunnerConfig
from pi0.rollout.policies import collect_expert_demos
from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import PI0_CFG_Adapter, Window
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig, RLOptimizerPI0_CFG
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


def init_states_for(states: Sequence[tuple[int, int]]) -> int:
    """Arena init states a runner needs to serve ``states`` (at least the default 200)."""
    return max(200, 1 + max(i for _, i in states))


def arena_expert_demos(demo_states: Sequence[tuple[int, int]], horizon: int, replan_steps: int, resolution: int = 64,
                       noise: float = 0.0, seed: int = 0, aim_error: float = 0.0) -> list[tuple[Episode, np.ndarray]]:
    """:func:`collect_expert_demos` on ``demo_states`` through an in-process arena runner sized to them."""
    with arena_runner(8, replan_steps, resolution, num_init_states=init_states_for(demo_states)) as runner:
        return collect_expert_demos(runner, demo_states, horizon, noise, seed, aim_error)


def demo_windows(policy: PI0Policy, demos: Sequence[tuple[Episode, np.ndarray]]) -> list[Window]:
    """Expert demos (episode, chunks (D, H, 7)) -> SFT / anchor windows of ``policy`` (executed-action targets)."""
    adapter = PI0_CFG_Adapter(policy, target="executed")
    return [w for e, chunks in demos for w in adapter.demo_windows(e, chunks)]


def demo_norm_stats(demos: Sequence[tuple[Episode, np.ndarray]]) -> NormStats:
    """z-score / quantile stats of the client state (8,) and the expert actions (7,) of the demos."""
    states = np.stack([libero_client_obs(d.obs, 16)["state"] for e, _ in demos for d in e.decisions])
    acts = np.concatenate([c.reshape(-1, c.shape[-1]) for _, c in demos])

    def st(x: np.ndarray, floor: float) -> Stats:
        # a std floor keeps near-constant dims (the demo gripper orientation) from blowing up off-distribution
        return Stats(x.mean(0), np.maximum(x.std(0), floor), np.quantile(x, 0.01, 0), np.quantile(x, 0.99, 0))
    return {"state": st(states, 0.1), "actions": st(acts, 0.05)}


def evaluate(runner: RolloutRunner, policy: PI0Policy, states: Sequence[tuple[int, int]], repeats: int = 1,
             seed: int = 0, guidance: float | None = None) -> float:
    """Success rate of ``policy`` on ``states`` x ``repeats`` (``guidance`` temporarily overrides w)."""
    old = policy.config.cfg_guidance
    if guidance is not None:
        policy.config.cfg_guidance = float(guidance)
    try:
        eps = runner.run(list(states), group_size=repeats,
                         policy=Pi0ChunkPolicy(policy, torch.Generator().manual_seed(seed)))
    finally:
        policy.config.cfg_guidance = old
    return float(np.mean([e.success for e in eps]))


def sft(policy: PI0Policy, windows: Sequence[Window], opt_cfg: OptimizerConfig, steps: int | None = None,
        seconds: float | None = None, seed: int = 0, optimizer: RLOptimizerPI0_CFG | None = None,
        log_every: int = 0) -> RLOptimizerPI0_CFG:
    """Flow-matching SFT on ``windows`` for ``steps`` optimizer steps or ``seconds`` of wall-clock."""
    opt = optimizer or RLOptimizerPI0_CFG(PI0_CFG_Adapter(policy, target="executed"), opt_cfg, seed=seed)
    t0, done = time.perf_counter(), 0
    while (steps is None or done < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
        st = opt.step(windows, use_condition=False, max_steps=1 if seconds is not None else (steps - done))
        done += int(st["steps"] + st["skipped_steps"])
        if log_every and done % log_every == 0:
            print(f"sft step {done} loss {st.get('loss', float('nan')):.4f}", flush=True)
    policy.eval()
    return opt


@dataclass
class WarmStop:
    """Stop the warm-start SFT early, the first time success on ``val_states`` reaches ``success``.

    Checked every ``every`` steps (one rollout per state). The validation states must be disjoint from the
    states a bench evaluates on; they give a deliberately weak start at a chosen level, whatever the step at
    which SFT starts to generalise varies (400-demo runs read 0.75 at 3000 steps and 0.15 at 2500).
    """

    success: float
    val_states: list[tuple[int, int]]
    every: int = 250


def warm_start_key(cfg: TinyArenaConfig, demo_states: Sequence[tuple[int, int]], sft_steps: int,
                   opt_cfg: OptimizerConfig, demo_noise: float = 0.0, stop: WarmStop | None = None,
                   aim_error: float = 0.0) -> str:
    """Cache key of a warm-started checkpoint."""
    extra: list = [demo_noise] if demo_noise else []  # keeps the keys of noise-free warm starts unchanged
    if stop is not None:
        extra.append(asdict(stop))
    if aim_error:
        extra.append({"aim_error": aim_error})
    blob = json.dumps([asdict(cfg), [list(s) for s in demo_states], sft_steps, asdict(opt_cfg), *extra],
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def cached_warm_start(cfg: TinyArenaConfig, demo_states: Sequence[tuple[int, int]], sft_steps: int,
                      opt_cfg: OptimizerConfig, cache_dir: Path | None = None, resolution: int = 64,
                      demo_noise: float = 0.0, stop: WarmStop | None = None, aim_error: float = 0.0
                      ) -> tuple[PI0Policy, list[Window], Path]:
    """SFT'd tiny policy + its demo windows, computed once and cached under ``<cache>/ript_warm_start/<key>``.

    ``sft_steps`` SFT steps, or fewer with ``stop`` (see :class:`WarmStop`); ``<key>/warm_start.json`` records
    the steps taken and the validation curve. ``aim_error`` > 0: mixed-quality demos (``collect_expert_demos``).
    """
    root = (cache_dir or default_cache_dir()) / "ript_warm_start" / warm_start_key(cfg, demo_states, sft_steps,
                                                                                  opt_cfg, demo_noise, stop, aim_error)
    torch.manual_seed(cfg.seed)
    demos = arena_expert_demos(demo_states, cfg.action_horizon, cfg.n_action_steps, resolution, demo_noise, cfg.seed,
                               aim_error)
    if (root / "model.safetensors").is_file():
        policy = PI0Policy.from_pretrained(root)
    else:
        policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
    windows = demo_windows(policy, demos)
    if not (root / "model.safetensors").is_file():
        curve = []
        if stop is None:
            sft(policy, windows, opt_cfg, steps=sft_steps, seed=cfg.seed)
        else:
            val_runner = arena_runner(min(50, len(stop.val_states)), cfg.n_action_steps, resolution,
                                      num_init_states=init_states_for(stop.val_states))
            opt, done = None, 0
            try:
                while done < sft_steps:
                    n = min(stop.every, sft_steps - done)
                    opt = sft(policy, windows, opt_cfg, steps=n, seed=cfg.seed, optimizer=opt)
                    done += n
                    curve.append({"steps": done, "val_success": evaluate(val_runner, policy, stop.val_states)})
                    print(f"warm start: {done} SFT steps, validation success {curve[-1]['val_success']:.3f}",
                          flush=True)
                    if curve[-1]["val_success"] >= stop.success:
                        break
            finally:
                val_runner.close()
        tmp = root.with_name(root.name + ".tmp")
        policy.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps({"config": asdict(cfg), "sft_steps_max": sft_steps,
                                                         "stop": asdict(stop) if stop else None, "curve": curve}))
        tmp.rename(root)
    return policy, windows, root
