r"""Bench: does RIPT-CFG measurably improve a weak pi0 on held-out arena init states?

A tiny pi0 (same architecture, small sizes, ``init="scratch"``) is warm-started by SFT on scripted-expert demos,
stopped once validation success reaches ``--warm_success`` (cached), then fine-tuned by RIPT-CFG for a wall-clock
budget: K rollouts per init state from a frozen behaviour snapshot, RLOO, the CFG-style flow update on the windows of
the successful rollouts (executed-action targets), each update joined by ``--anchor_ratio`` of the warm start's own
demo windows per rollout window (no new demos). Every ``--behavior_refresh`` iterations the trained policy and the
snapshot roll out on ``--refresh_gate`` training states with the same flow noise, and the snapshot takes the trained
weights only if they win (gated policy iteration). ``--anchor_ratio 0`` is RL alone (add ``--replay_windows``);
``--no-train_on_rollouts`` the anchor-only control. Findings: bench/results/rl_diagnosis.md.
In the same run: the RL model at w=1, continued SFT on the same demos for the same wall-clock, and success
against w in {0, 1, 1.5, 2, 3}. Writes <out>/rl_improvement.json and .png; the last line is
``before=<r> after=<r> w1=<r> sft=<r> minutes=<m>``.

    nice -n 10 .venv/bin/python bench/rl_improvement.py --minutes 20 --out runs/bench_rl
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig  # noqa: E402
from pi0.ript.init_states import InitStateSampler  # noqa: E402
from pi0.ript.trainer import RIPTTrainer, RLConfig  # noqa: E402
from pi0.ript.warm_start import (  # noqa: E402
    TinyArenaConfig, WarmStop, arena_runner, cached_warm_start, evaluate, sft)
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config:
    """Bench options."""

    task_ids: list[int] = field(default_factory=lambda: [4])
    num_demos: int = 400  # expert demos per task (init states 0..n-1) for the warm start
    sft_steps: int = 6000  # most warm-start SFT steps (cached); it stops earlier at warm_success
    warm_success: float = 0.3  # stop the warm start once success on the validation states reaches this
    val_states: int = 100  # validation init states eval_start-val_states..eval_start-1 (warm-start stop only)
    warm_check_every: int = 100  # SFT steps between two validation checks of the warm start
    train_states: int = 1500  # RL init states per task (0..n-1, includes the demo states; RL gets no demos)
    eval_start: int = 1600  # held-out init states eval_start.. (never trained on, no demos)
    eval_states: int = 100  # 40 states read 0.05-0.22 for one policy across flow-noise seeds
    num_init_states: int = 2000  # arena layouts per task (pure functions of (task, id); only an upper bound)
    minutes: float = 20.0  # RL wall-clock budget (rollouts + updates + periodic evals)
    objective: str = "cfg"  # "cfg" | "ppo" (RLConfig.objective; ppo needs --anchor_ratio 0)
    noise_level: float = 0.5  # ppo: the Flow-SDE noise level
    clip: float = 0.2  # ppo: the ratio clip
    eval_every: int = 10
    num_groups: int = 4
    group_size: int = 8
    cfg_guidance: float = 1.5
    p_uncond: float = 0.3
    # "executed": the actions the env ran (the chunk's unexecuted tail is masked out: it never affected the reward);
    # (session 6 measured RL-only second-half success 0.49 vs 0.38 with "model_actions"; its logs were not kept)
    target: str = "executed"
    advantage_weighting: bool = False  # positive windows weighted by A / mean(A+) (RLConfig)
    negative_weight: float = 0.0  # loss weight of A <= 0 windows (1 = plain CFGRL; own failures degrade the policy)
    # warm-start demo windows (as positives) per trained rollout window in each update (DAPG-style demo term);
    # 0 = RL alone. Findings: bench/results/rl_diagnosis.md, session 6
    anchor_ratio: float = 6.0
    train_on_rollouts: bool = True  # False: the anchor-only control (rollouts collected, left out of the update)
    # who collects: "frozen" (a no-grad snapshot of the policy, see RLConfig.behavior) | "current" (on-policy, as
    # RIPT: training on its own samples compounds the fitting error and degrades this tiny policy)
    behavior: str = "frozen"
    behavior_refresh: int = 10  # iterations between two refresh tests of the snapshot (0 = never refreshed)
    refresh_gate: int = 64  # > 0: a refresh happens only if the trained policy wins a paired test on this many states
    replay_windows: int = 0  # > 0: updates sample their rollout windows from a FIFO of this many (RLConfig)
    replay_sample: int = 0  # rollout windows per update from the replay (0 = as many as the iteration brought)
    lr: float = 3e-4
    epochs: int = 1
    minibatch_size: int = 32
    image_size: int = 56
    patch_size: int = 14  # SigLIP patch (image_size // patch_size)^2 tokens per camera
    vision_width: int = 32
    depth: int = 2
    demo_noise: float = 0.0  # > 0: demos execute a noisy expert, labelled with clean expert chunks (DART)
    # > 0: mixed-quality demos from an expert that misjudges the blocks' y by a per-episode offset in [-e, e] metres
    # (ArenaExpert.aim_offset), labelled with its own actions, failures included
    demo_aim_error: float = 0.0
    sft_lr: float = 1e-3  # warm start and continued-SFT baseline
    threads: int = 1  # torch threads (1 is fastest on a loaded 2-core machine: no spin-waiting)
    seed: int = 0
    out: str = "runs/bench_rl"
    sft_baseline: bool = True  # run the continued-SFT baseline beside RL
    sft_only: bool = False  # internal: the continued-SFT baseline process (runs beside RL, same wall-clock)


def warm_stop(cfg: Config) -> WarmStop:
    """When the warm start stops: validation states just below the held-out ones, disjoint from RL's states."""
    val = [(t, i) for t in cfg.task_ids for i in range(cfg.eval_start - cfg.val_states, cfg.eval_start)]
    return WarmStop(cfg.warm_success, val, cfg.warm_check_every)


def sft_baseline(cfg: Config, tcfg: TinyArenaConfig, policy: PI0Policy, windows: list, sft_opt: OptimizerConfig,
                 held_out: list) -> None:
    """Continued SFT of the warm start ``policy`` on its own demo ``windows`` for ``minutes``, then held-out success."""
    t0 = time.perf_counter()
    opt = sft(policy, windows, sft_opt, seconds=cfg.minutes * 60, seed=cfg.seed + 1)
    minutes = (time.perf_counter() - t0) / 60
    runner = arena_runner(num_envs=cfg.num_groups * cfg.group_size, replan_steps=tcfg.n_action_steps,
                          num_init_states=cfg.num_init_states)
    rate = evaluate(runner, policy, held_out, seed=cfg.seed + 1)
    runner.close()
    (Path(cfg.out) / "sft_baseline.json").write_text(json.dumps({"sft": rate, "minutes": minutes,
                                                                 "skipped_steps": opt.num_skipped}))


def main(argv: list[str] | None = None) -> dict:
    """Run the bench and print the summary line."""
    cfg = parse_config(Config, argv, __doc__)
    if cfg.num_demos > cfg.train_states or cfg.train_states > cfg.eval_start - cfg.val_states \
            or cfg.eval_start + cfg.eval_states > cfg.num_init_states:
        raise ValueError(f"demo states 0..{cfg.num_demos - 1} must lie within the RL states 0..{cfg.train_states - 1}, "
                         f"which must not overlap the validation states {cfg.eval_start - cfg.val_states}.."
                         f"{cfg.eval_start - 1} or the held-out states {cfg.eval_start}.."
                         f"{cfg.eval_start + cfg.eval_states - 1}, which must lie below --num_init_states "
                         f"{cfg.num_init_states}: set num_demos <= train_states <= eval_start - val_states and "
                         "eval_start + eval_states <= num_init_states")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    tcfg = TinyArenaConfig(image_size=cfg.image_size, patch_size=cfg.patch_size, vision_width=cfg.vision_width,
                           depth=cfg.depth, seed=cfg.seed)
    sft_opt = OptimizerConfig(lr=cfg.sft_lr, minibatch_size=32)
    demo_states = [(t, i) for t in cfg.task_ids for i in range(cfg.num_demos)]
    t0 = time.perf_counter()
    policy, windows, ckpt = cached_warm_start(tcfg, demo_states, cfg.sft_steps, sft_opt, demo_noise=cfg.demo_noise,
                                           stop=warm_stop(cfg), aim_error=cfg.demo_aim_error)
    warm = json.loads((ckpt / "warm_start.json").read_text()) if (ckpt / "warm_start.json").is_file() else {}
    steps = warm["curve"][-1]["steps"] if warm.get("curve") else cfg.sft_steps
    print(f"warm start: {len(windows)} demo windows from {len(demo_states)} demos, {steps} SFT steps "
          f"({time.perf_counter() - t0:.0f}s, cached at {ckpt})", flush=True)
    held_out = [(t, i) for t in cfg.task_ids for i in range(cfg.eval_start, cfg.eval_start + cfg.eval_states)]
    if cfg.sft_only:
        sft_baseline(cfg, tcfg, policy, windows, sft_opt, held_out)
        return {}
    runner = arena_runner(num_envs=cfg.num_groups * cfg.group_size, replan_steps=tcfg.n_action_steps,
                          num_init_states=cfg.num_init_states)
    before = evaluate(runner, policy, held_out, seed=cfg.seed)
    print(f"before RL: held-out success {before:.3f}", flush=True)
    # continued SFT for the same wall-clock runs beside RL (same machine load), in its own process
    sft_proc = subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                 "--sft_only"]) if cfg.sft_baseline else None

    rl = RLConfig(objective=cfg.objective, noise_level=cfg.noise_level, clip=cfg.clip,
                  num_groups=cfg.num_groups, group_size=cfg.group_size, p_uncond=cfg.p_uncond,
                  cfg_guidance=cfg.cfg_guidance, target=cfg.target, advantage_weighting=cfg.advantage_weighting,
                  negative_weight=cfg.negative_weight,
                  anchor_ratio=cfg.anchor_ratio, behavior=cfg.behavior, behavior_refresh=cfg.behavior_refresh,
                  refresh_gate=cfg.refresh_gate, replay_windows=cfg.replay_windows,
                  replay_sample=cfg.replay_sample, train_on_rollouts=cfg.train_on_rollouts,
                  eval_every=cfg.eval_every, seed=cfg.seed,
                  opt=OptimizerConfig(lr=cfg.lr, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size))
    sampler = InitStateSampler({t: range(cfg.train_states) for t in cfg.task_ids}, seed=cfg.seed)
    trainer = RIPTTrainer(policy, runner, sampler, rl, eval_states=held_out, anchor_windows=windows)
    curve = [{"iteration": 0, "minutes": 0.0, "eval": before}]
    t_rl = time.perf_counter()

    def log(st: dict) -> None:
        m = (time.perf_counter() - t_rl) / 60
        line = (f"it {int(st['iteration'])} {m:.1f}min rollout_sr {st['rollout/success_rate']:.2f} "
                f"kept {st['rollout/frac_groups_kept']:.2f} pos {st['train/frac_positive']:.2f} "
                f"loss_c {st.get('train/loss_cond', float('nan')):.3f} loss_u {st.get('train/loss_uncond', float('nan')):.3f}")
        if "behavior/refreshed" in st:
            line += (f" GATE trained {st['behavior/candidate_success']:.2f} vs snapshot "
                     f"{st['behavior/snapshot_success']:.2f}: {'refreshed' if st['behavior/refreshed'] else 'kept'}")
        line += f" win {int(st['train/windows'])}"
        if "eval/success_rate" in st:
            curve.append({"iteration": st["iteration"], "minutes": m, "eval": st["eval/success_rate"]})
            line += f" EVAL {st['eval/success_rate']:.3f}"
        print(line, flush=True)

    trainer.train(10**6, seconds=cfg.minutes * 60, callback=log)
    rl_seconds = time.perf_counter() - t_rl
    after = evaluate(runner, policy, held_out, seed=cfg.seed + 1, guidance=cfg.cfg_guidance)
    by_w = {w: evaluate(runner, policy, held_out, seed=cfg.seed + 1, guidance=w) for w in (0.0, 1.0, 1.5, 2.0, 3.0)}
    print(f"after RL ({rl_seconds / 60:.1f} min): w={cfg.cfg_guidance} {after:.3f}; by w {by_w}", flush=True)

    runner.close()
    if sft_proc is not None and sft_proc.wait() != 0:
        raise RuntimeError("the continued-SFT baseline process failed")
    sft_res = json.loads((out / "sft_baseline.json").read_text()) if sft_proc else {"sft": -1.0, "minutes": 0.0}
    sft_rate = sft_res["sft"]
    print(f"continued SFT ({sft_res['minutes']:.1f} min, beside RL): {sft_rate:.3f}", flush=True)
    policy.save_pretrained(out / "rl_policy")

    result = {"config": asdict(cfg), "warm_start": warm, "before": before, "after": after, "w1": by_w[1.0],
              "sft": sft_rate,
              "success_vs_w": {str(k): v for k, v in by_w.items()}, "minutes": rl_seconds / 60, "curve": curve,
              "iterations": trainer.curve, "load_before": load0, "load_after": os.getloadavg(),
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    (out / "rl_improvement.json").write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([c["iteration"] for c in curve], [c["eval"] for c in curve], "o-", label=f"RIPT-CFG (w={cfg.cfg_guidance})")
    ax[0].axhline(sft_rate, color="gray", ls="--", label="continued SFT (same wall-clock)")
    ax[0].set_xlabel("RL iteration"), ax[0].set_ylabel("held-out success"), ax[0].set_ylim(0, 1), ax[0].legend()
    ax[1].plot(list(by_w), list(by_w.values()), "s-"), ax[1].set_xlabel("guidance w"), ax[1].set_ylim(0, 1)
    ax[1].set_title("success vs w after RL")
    fig.tight_layout()
    fig.savefig(out / "rl_improvement.png", dpi=100)
    print(f"before={before:.3f} after={after:.3f} w1={by_w[1.0]:.3f} sft={sft_rate:.3f} minutes={rl_seconds / 60:.1f}")
    return result


if __name__ == "__main__":
    main()
