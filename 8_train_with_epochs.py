r"""Stage 8: RIPT with epochs and batched updates, dynamic sampling and an init-state history.

Adds to stage 7: several epochs of minibatched updates (gradient accumulation, clipping, NaN/inf guard) per
iteration; dynamic sampling (groups whose K rewards are all equal carry no signal and are dropped, and collection
goes on until B informative groups are kept); an init-state history (a state whose last K rollouts all succeeded
is skipped, then re-probed after N skips; saved to / resumed from JSON); bounded collection (after
--max_collect_attempts rounds, or when every state is solved, it stops with a message instead of looping
forever); periodic evaluation on held-out init states.

    .venv/bin/python 8_train_with_epochs.py --iterations 5 --epochs 2 --grad_accum_steps 2
    .venv/bin/python 8_train_with_epochs.py --history runs/stage8/history.json   # resumes the history if present
    MUJOCO_GL=egl .venv/bin/python 8_train_with_epochs.py --env libero --suite libero_spatial --task_ids 0 \
        --iterations 1 --num_groups 1 --group_size 2 --max_steps 20 --eval_states 1 --num_envs 2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.stage_setup import load_policy, make_runner, make_writer, split_states
from pi0.ript.trainer import RIPTTrainer, RLConfig
from pi0.utils.cli import parse_config


@dataclass
class Config:
    """Stage 8 options."""

    env: str = "arena"  # "arena" | "libero"
    suite: str = "libero_spatial"
    task_ids: list[int] = field(default_factory=lambda: [4])
    checkpoint: str = ""  # default: tiny arena warm start (cached) / tiny random pi0 for LIBERO
    iterations: int = 5
    num_groups: int = 4  # B informative groups per iteration
    group_size: int = 4  # K rollouts per init state
    max_collect_attempts: int = 3  # collection rounds per iteration (bounded sampling)
    dynamic_sampling: bool = True
    history: str = ""  # JSON path of the init-state history ("" = <out_dir>/history.json)
    reprobe_after: int = 3  # skips before a solved state is tried again
    train_states: int = 40
    eval_start: int = 40
    eval_states: int = 10
    eval_every: int = 1
    epochs: int = 2
    minibatch_size: int = 16
    grad_accum_steps: int = 2
    max_grad_norm: float = 1.0
    lr: float = 3e-4
    cfg_guidance: float = 1.0
    p_uncond: float = 0.3
    target: str = "model_actions"  # "model_actions" | "executed"
    advantage_weighting: bool = False
    negative_weight: float = 1.0  # loss weight of A <= 0 windows (1 = plain CFGRL)
    num_envs: int = 16
    max_steps: int = 0
    save_every: int = 5
    threads: int = 1
    seed: int = 0
    out_dir: str = "runs/stage8"


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and report."""
    cfg = parse_config(Config, argv, __doc__)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    hist_path = Path(cfg.history) if cfg.history else out / "history.json"
    history = InitStateHistory.load(hist_path) if hist_path.is_file() else InitStateHistory(cfg.reprobe_after)
    train, held_out = split_states(cfg.task_ids, cfg.train_states, cfg.eval_start, cfg.eval_states)
    policy = load_policy(cfg.env, cfg.checkpoint, cfg.task_ids)
    rl = RLConfig(num_groups=cfg.num_groups, group_size=cfg.group_size, p_uncond=cfg.p_uncond,
                  cfg_guidance=cfg.cfg_guidance, target=cfg.target, advantage_weighting=cfg.advantage_weighting,
                  negative_weight=cfg.negative_weight, dynamic_sampling=cfg.dynamic_sampling,
                  max_collect_attempts=cfg.max_collect_attempts,
                  eval_every=cfg.eval_every, seed=cfg.seed,
                  opt=OptimizerConfig(lr=cfg.lr, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size,
                                      grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm))
    with make_runner(cfg.env, cfg.suite, cfg.task_ids, policy, cfg.num_envs, cfg.max_steps) as runner:
        trainer = RIPTTrainer(policy, runner, InitStateSampler(train, cfg.seed), rl, held_out, history=history,
                              writer=make_writer(out))
        for it in tqdm(range(cfg.iterations), desc="RIPT-CFG epochs"):
            st = trainer.step()
            history.save(hist_path)
            tqdm.write(f"iter {it + 1}: rollout success {st['rollout/success_rate']:.2f}, groups kept "
                       f"{st['rollout/frac_groups_kept']:.2f}, skipped states {int(st['rollout/skipped_states'])}, "
                       f"{int(st['train/steps'])} steps ({int(st['train/skipped_steps'])} skipped non-finite), "
                       f"held-out success {st.get('eval/success_rate', float('nan')):.2f}")
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                policy.save_pretrained(out / "checkpoints" / f"iter_{it + 1:04d}")
    trainer.save_curve(out / "curve.json")
    print(f"saved {out / 'checkpoints'}, {out / 'curve.json'} and the history {hist_path}")
    return trainer.curve


if __name__ == "__main__":
    main()
