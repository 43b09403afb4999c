r"""Diagnostic: does training a flow policy on its OWN samples degrade it, and does a frozen teacher's do the same?

The control experiment behind ``RLConfig.behavior`` (bench/results/rl_diagnosis.md, session 3). A tiny arena
pi0 is SFT'd to convergence on expert demos (cached), then trained for ``--rounds`` rounds of {roll out 32
episodes (4 init states x 8) with the policy being trained; build windows at the visited decision points; one
epoch of the flow-matching loss}. Only the TARGETS differ between modes:

- ``own``: the chunks the current policy sampled there (pure self-distillation; ``--successes_only`` keeps the
  successful episodes: filtered BC);
- ``deterministic``: the current policy's chunk from zero flow noise at the same inputs;
- ``frozen``: a chunk sampled by a frozen copy of the starting policy at the same inputs (same states, fixed
  targets: what ``behavior="frozen"`` gives RL's branches).

Held-out success (100 states) is printed every ``--eval_every`` rounds; the last line is
``start=<r> end=<r> mode=<m> lr=<lr> rounds=<n>``. ``--lr 0`` is the no-update control.

    .venv/bin/python bench/self_training.py --mode own
    .venv/bin/python bench/self_training.py --mode frozen
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

from pi0.policies.libero import Pi0ChunkPolicy  # noqa: E402
from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import PI0_CFG_Adapter  # noqa: E402
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig, RLOptimizerPI0_CFG  # noqa: E402
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, cached_warm_start, evaluate  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402

MODES = ("own", "deterministic", "frozen")


@dataclass
class Config:
    """Diagnostic options."""

    mode: str = "own"  # one of MODES: where the training targets come from
    successes_only: bool = False  # keep only the windows of successful episodes
    lr: float = 3e-4
    rounds: int = 12
    eval_every: int = 4
    num_demos: int = 400  # expert demos (task 4, init states 0..n-1) of the converged SFT start
    sft_steps: int = 4500  # SFT steps of the start (cached); 400 demos x 4500 steps reads 0.5-0.9 held-out
    train_states: int = 1500  # rollout init states 0..n-1
    eval_start: int = 1600  # held-out init states eval_start..eval_start+99
    seed: int = 0


def retarget(windows: list[dict], adapter: PI0_CFG_Adapter, source: torch.nn.Module, zero_noise: bool,
             generator: torch.Generator) -> None:
    """Replace each window's action target (H, A) by ``source``'s chunk at the window's own inputs."""
    for i in range(0, len(windows), 64):
        part = windows[i: i + 64]
        b = adapter.collate(part)
        shape = b["actions"].shape
        noise = torch.zeros(shape) if zero_noise else torch.randn(shape, generator=generator)
        with torch.no_grad():
            acts = source.sample_actions(b["images"], b["img_masks"], b["lang_tokens"], b["lang_masks"], b["state"],
                                         noise=noise, num_steps=adapter.policy.config.num_steps).numpy()
        for w, a in zip(part, acts):
            w["actions"] = a


def main(argv: list[str] | None = None) -> dict:
    """Run the rounds and print the summary line."""
    cfg = parse_config(Config, argv, __doc__)
    if cfg.mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, got {cfg.mode!r}")
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    tcfg = TinyArenaConfig(seed=cfg.seed)
    t0 = time.perf_counter()
    policy, _, ckpt = cached_warm_start(tcfg, [(4, i) for i in range(cfg.num_demos)], cfg.sft_steps,
                                        OptimizerConfig(lr=1e-3, minibatch_size=32))
    print(f"start: {cfg.num_demos} demos x {cfg.sft_steps} SFT steps ({time.perf_counter() - t0:.0f}s, {ckpt})",
          flush=True)
    teacher = copy.deepcopy(policy.model).eval().requires_grad_(False)
    adapter = PI0_CFG_Adapter(policy, "model_actions")
    opt = RLOptimizerPI0_CFG(adapter, OptimizerConfig(lr=cfg.lr, minibatch_size=32), seed=cfg.seed)
    runner = arena_runner(32, tcfg.n_action_steps, num_init_states=cfg.eval_start + 100)
    held = [(4, i) for i in range(cfg.eval_start, cfg.eval_start + 100)]
    gen, rng = torch.Generator().manual_seed(cfg.seed), np.random.default_rng(cfg.seed)
    start = evaluate(runner, policy, held)
    curve = [start]
    print(f"round 0: held-out {start:.2f}", flush=True)
    for r in range(1, cfg.rounds + 1):
        policy.eval()
        states = [(4, int(i)) for i in rng.integers(0, cfg.train_states, 4)]
        eps = runner.run(states, group_size=8, policy=Pi0ChunkPolicy(policy, gen))
        windows = [w for e in eps if e.success or not cfg.successes_only for w in adapter.episode_windows(e, 0.0)]
        if cfg.mode != "own":
            retarget(windows, adapter, policy.model if cfg.mode == "deterministic" else teacher,
                     cfg.mode == "deterministic", gen)
        st = opt.step(windows, use_condition=False)
        line = (f"round {r}: rollout success {np.mean([e.success for e in eps]):.2f}, {len(windows)} windows, "
                f"{int(st['steps'])} steps, loss {st.get('loss', float('nan')):.3f}")
        if r % cfg.eval_every == 0 or r == cfg.rounds:
            curve.append(evaluate(runner, policy, held))
            line += f", held-out {curve[-1]:.2f}"
        print(line, flush=True)
    runner.close()
    print(f"start={start:.2f} end={curve[-1]:.2f} mode={cfg.mode}{'+successes' if cfg.successes_only else ''} "
          f"lr={cfg.lr:g} rounds={cfg.rounds}")
    return {"start": start, "curve": curve}


if __name__ == "__main__":
    main()
