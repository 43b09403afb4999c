r"""Stage 7: the RIPT RL core. Adds: improving a policy from interaction.

One process: sample B init states, collect K rollouts of each (a group) with the current policy, binary success
rewards, leave-one-out (RLOO) advantages, then one CFG-style advantage-conditioned flow-matching update (positive
rollouts train the "optimality"-conditioned branch, condition dropout trains the unconditioned one; sampling uses
v = v_u + w (v_c - v_u)), and evaluation on held-out init states. TensorBoard scalars under <out_dir>/tb,
checkpoints (PI0Policy.save_pretrained) under <out_dir>/checkpoints.

    .venv/bin/python 7_train_with_rl_core.py --iterations 5                      # arena, tiny warm-started pi0
    MUJOCO_GL=egl .venv/bin/python 7_train_with_rl_core.py --env libero --suite libero_spatial --task_ids 0 \
        --iterations 1 --num_groups 1 --group_size 2 --max_steps 20 --eval_states 1 --num_envs 2
    # one runner per rank is not needed here: RL on one machine is one process (the runner has env workers)
"""

from __future__ import annotations

from dataclasses import dataclass

from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.stage_setup import StageConfig, run_stage
from pi0.utils.cli import parse_config


@dataclass
class Config(StageConfig):
    """Stage 7 options (all shared with stage 8: see pi0.ript.stage_setup.StageConfig)."""


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and report."""
    cfg = parse_config(Config, argv, __doc__)
    rl = cfg.rl_config(OptimizerConfig(lr=cfg.lr, minibatch_size=cfg.minibatch_size), dynamic_sampling=False)
    return run_stage(cfg, rl, "RIPT-CFG", lambda st: (
        f"rollout success {st['rollout/success_rate']:.2f}, positives {st['train/frac_positive']:.2f}, loss cond "
        f"{st.get('train/loss_cond', float('nan')):.4f} uncond {st.get('train/loss_uncond', float('nan')):.4f}, "
        f"held-out success {st.get('eval/success_rate', float('nan')):.2f}, rollout {st['time/rollout_s']:.1f}s "
        f"update {st['time/update_s']:.1f}s"))


if __name__ == "__main__":
    main()
