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

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.init_states import InitStateSampler
from pi0.ript.stage_setup import load_policy, make_runner, make_writer, split_states
from pi0.ript.trainer import RIPTTrainer, RLConfig
from pi0.utils.cli import parse_config


@dataclass
class Config:
    """Stage 7 options."""

    env: str = "arena"  # "arena" | "libero"
    suite: str = "libero_spatial"
    task_ids: list[int] = field(default_factory=lambda: [4])
    checkpoint: str = ""  # default: tiny arena warm start (cached) / tiny random pi0 for LIBERO
    iterations: int = 5
    num_groups: int = 4  # B init states per iteration
    group_size: int = 4  # K rollouts per init state
    train_states: int = 40  # training init states per task: 0..n-1
    eval_start: int = 40  # held-out init states eval_start..eval_start+eval_states-1
    eval_states: int = 10
    cfg_guidance: float = 1.0
    p_uncond: float = 0.3
    target: str = "model_actions"  # "model_actions" | "executed"
    lr: float = 3e-4
    minibatch_size: int = 32
    num_envs: int = 16
    max_steps: int = 0  # 0: the env's limit
    save_every: int = 5
    threads: int = 1
    seed: int = 0
    out_dir: str = "runs/stage7"


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and report."""
    cfg = parse_config(Config, argv, __doc__)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train, held_out = split_states(cfg.task_ids, cfg.train_states, cfg.eval_start, cfg.eval_states)
    policy = load_policy(cfg.env, cfg.checkpoint, cfg.task_ids)
    rl = RLConfig(num_groups=cfg.num_groups, group_size=cfg.group_size, p_uncond=cfg.p_uncond,
                  cfg_guidance=cfg.cfg_guidance, target=cfg.target, dynamic_sampling=False, seed=cfg.seed,
                  opt=OptimizerConfig(lr=cfg.lr, minibatch_size=cfg.minibatch_size))
    out = Path(cfg.out_dir)
    with make_runner(cfg.env, cfg.suite, cfg.task_ids, policy, cfg.num_envs, cfg.max_steps) as runner:
        trainer = RIPTTrainer(policy, runner, InitStateSampler(train, cfg.seed), rl, held_out, writer=make_writer(out))
        for it in tqdm(range(cfg.iterations), desc="RIPT-CFG"):
            st = trainer.step()
            tqdm.write(f"iter {it + 1}: rollout success {st['rollout/success_rate']:.2f}, positives "
                       f"{st['train/frac_positive']:.2f}, loss cond {st.get('train/loss_cond', float('nan')):.4f} "
                       f"uncond {st.get('train/loss_uncond', float('nan')):.4f}, held-out success "
                       f"{st.get('eval/success_rate', float('nan')):.2f}, rollout {st['time/rollout_s']:.1f}s "
                       f"update {st['time/update_s']:.1f}s")
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                policy.save_pretrained(out / "checkpoints" / f"iter_{it + 1:04d}")
    trainer.save_curve(out / "curve.json")
    print(f"saved {out / 'checkpoints'} and {out / 'curve.json'}")
    return trainer.curve


if __name__ == "__main__":
    main()
