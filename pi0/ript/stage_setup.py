"""What stages 7 and 8 share: their options (:class:`StageConfig`), the policy (a checkpoint or the cached tiny
arena warm start), the runner (arena in-process or LIBERO subprocess workers), init-state splits, TensorBoard,
and the training loop with its checkpoints (:func:`run_stage`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pi0.envs import make_env_spec
from pi0.modeling_pi0 import PI0Policy
from pi0.rollout import RolloutRunner, libero_runner_config
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.trainer import RIPTTrainer, RLConfig
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, cached_warm_start

ENVS = ("arena", "libero")


def load_policy(env: str, checkpoint: str, task_ids: Sequence[int], warm_start_demos: int = 10,
                warm_start_steps: int = 300, device: str = "cpu") -> PI0Policy:
    """``checkpoint`` if given; else the tiny arena warm start (cached) or, for LIBERO, the tiny random pi0."""
    if env not in ENVS:
        raise ValueError(f"unknown env {env!r}; choose one of {ENVS}")
    if checkpoint:
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"checkpoint {checkpoint} does not exist (give a directory written by "
                                    "PI0Policy.save_pretrained or convert_pi0_to_hf_lerobot.py)")
        return PI0Policy.from_pretrained(checkpoint, device=device)
    if env == "libero":
        from pi0.presets import tiny_policy
        return tiny_policy().to(device)
    demos = [(t, i) for t in task_ids for i in range(warm_start_demos)]
    policy, _, _ = cached_warm_start(TinyArenaConfig(), demos, warm_start_steps, OptimizerConfig(lr=1e-3))
    return policy.to(device)


def make_runner(env: str, suite: str, task_ids: Sequence[int], policy: PI0Policy, num_envs: int,
                max_steps: int = 0) -> RolloutRunner:
    """Arena: in-process envs; LIBERO: subprocess workers (MUJOCO_GL=egl), replanning every n_action_steps."""
    replan = policy.config.n_action_steps
    if env == "arena":
        return arena_runner(num_envs, replan, max_steps=max_steps or None)
    os.environ.setdefault("MUJOCO_GL", "egl")
    return RolloutRunner(make_env_spec("libero", suite, task_ids[0]), None,
                         libero_runner_config(num_envs=num_envs, replan_steps=replan, max_steps=max_steps or None))


def split_states(task_ids: Sequence[int], train: int, eval_start: int, eval_count: int
                 ) -> tuple[dict[int, range], list[tuple[int, int]]]:
    """Training ids 0..train-1 per task and held-out eval pairs eval_start..eval_start+eval_count-1."""
    if eval_count and eval_start < train:
        raise ValueError(f"held-out init states start at {eval_start} < train_states {train}: they would overlap")
    return ({int(t): range(train) for t in task_ids},
            [(int(t), i) for t in task_ids for i in range(eval_start, eval_start + eval_count)])


def make_writer(out_dir: str | Path) -> Any:
    """TensorBoard writer under ``<out_dir>/tb`` (rank 0 only; None elsewhere)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(Path(out_dir) / "tb"))


@dataclass
class StageConfig:
    """Options shared by stages 7 and 8 (each field is a ``--flag``; stage 8 adds its own)."""

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

    def rl_config(self, opt: OptimizerConfig, **changes: Any) -> RLConfig:
        """The trainer's RLConfig from these options (+ stage-specific ``changes``)."""
        return RLConfig(num_groups=self.num_groups, group_size=self.group_size, p_uncond=self.p_uncond,
                        cfg_guidance=self.cfg_guidance, target=self.target, seed=self.seed, opt=opt, **changes)


def run_stage(cfg: StageConfig, rl: RLConfig, desc: str, line: Callable[[dict[str, float]], str],
              history: InitStateHistory | None = None, history_path: Path | None = None) -> list[dict[str, float]]:
    """The loop of stages 7 and 8: train ``cfg.iterations`` iterations, print ``line(scalars)`` per iteration,
    save checkpoints every ``save_every`` iterations (and the history each iteration), then the curve."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    train, held_out = split_states(cfg.task_ids, cfg.train_states, cfg.eval_start, cfg.eval_states)
    policy = load_policy(cfg.env, cfg.checkpoint, cfg.task_ids)
    with make_runner(cfg.env, cfg.suite, cfg.task_ids, policy, cfg.num_envs, cfg.max_steps) as runner:
        trainer = RIPTTrainer(policy, runner, InitStateSampler(train, cfg.seed), rl, held_out, history=history,
                              writer=make_writer(out))
        for it in tqdm(range(cfg.iterations), desc=desc):
            st = trainer.step()
            if history is not None and history_path is not None:
                history.save(history_path)
            tqdm.write(f"iter {it + 1}: {line(st)}")
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                policy.save_pretrained(out / "checkpoints" / f"iter_{it + 1:04d}")
    trainer.save_curve(out / "curve.json")
    print(f"saved {out / 'checkpoints'} and {out / 'curve.json'}"
          + (f" and the history {history_path}" if history_path is not None else ""))
    return trainer.curve
