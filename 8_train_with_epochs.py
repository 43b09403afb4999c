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

from dataclasses import dataclass
from pathlib import Path

from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.init_states import InitStateHistory
from pi0.ript.stage_setup import StageConfig, run_stage
from pi0.utils.cli import parse_config


@dataclass
class Config(StageConfig):
    """Stage 8 options: stage 7's (pi0.ript.stage_setup.StageConfig) plus epochs, dynamic sampling, history."""

    minibatch_size: int = 16
    out_dir: str = "runs/stage8"
    max_collect_attempts: int = 3  # collection rounds per iteration (bounded sampling)
    dynamic_sampling: bool = True  # drop groups whose K rewards are all equal; B informative groups per iteration
    history: str = ""  # JSON path of the init-state history ("" = <out_dir>/history.json)
    reprobe_after: int = 3  # skips before a solved state is tried again
    eval_every: int = 1
    epochs: int = 2
    grad_accum_steps: int = 2
    max_grad_norm: float = 1.0
    advantage_weighting: bool = False
    negative_weight: float = 1.0  # loss weight of A <= 0 windows (1 = plain CFGRL)


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and report."""
    cfg = parse_config(Config, argv, __doc__)
    hist_path = Path(cfg.history) if cfg.history else Path(cfg.out_dir) / "history.json"
    history = InitStateHistory.load(hist_path) if hist_path.is_file() else InitStateHistory(cfg.reprobe_after)
    opt = OptimizerConfig(lr=cfg.lr, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size,
                          grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm)
    rl = cfg.rl_config(opt, advantage_weighting=cfg.advantage_weighting, negative_weight=cfg.negative_weight,
                       dynamic_sampling=cfg.dynamic_sampling, max_collect_attempts=cfg.max_collect_attempts,
                       eval_every=cfg.eval_every)
    return run_stage(cfg, rl, "RIPT-CFG epochs", lambda st: (
        f"rollout success {st['rollout/success_rate']:.2f}, groups kept {st['rollout/frac_groups_kept']:.2f}, "
        f"skipped states {int(st['rollout/skipped_states'])}, {int(st['train/steps'])} steps "
        f"({int(st['train/skipped_steps'])} skipped non-finite), held-out success "
        f"{st.get('eval/success_rate', float('nan')):.2f}"), history, hist_path)


if __name__ == "__main__":
    main()
