r"""Stage 7: the RIPT RL core. Adds: improving a policy from interaction.

One process: sample B init states, collect K rollouts of each (a group) with the current policy, binary success
rewards, leave-one-out (RLOO) advantages, then ONE update pass of the RL objective, and evaluation on held-out init
states. algo.objective=ppo (default): RIPT-VLA's LOOP for a flow policy: rollouts sampled with Flow-SDE record each
decision's denoising chain, and the update is the PPO-clipped ratio of that chunk's log-density under the new vs
the collecting weights, times the RLOO advantage. algo.objective=cfg: CFGRL (positives train the optimality-
conditioned branch, every window the reference; sampling uses v = v_u + w (v_c - v_u)). The iteration reads top-down
in pi0/ript/trainer.py (RIPTTrainer.step).

Configured by the one typed config tree (pi0.ript.config: sections algo, task, env, distributed, features,
logging): --config_path takes a bundled preset name or a YAML file (default: stage7_rl_core, a tiny arena run of
well under a minute on CPU) and key=value arguments override it. An unknown key or a bad value stops the run
before any work with one line (`error: ...`, exit 2). Stage 7 runs the core only and REFUSES (same one-line error,
naming the key) a config with features.enable_smart_sampling=true (dynamic sampling and the init-state history
are stage 8) or algo.opt.epochs != 1; it is single-process (torchrun: stages 10-11). Writes
<logging.out_dir>/<logging.run_name>/: config.yaml (resolved), tb/, curve.json, success.png, checkpoints/, final/.

    .venv/bin/python 7_train_with_rl_core.py                                   # arena, tiny warm-started pi0
    .venv/bin/python 7_train_with_rl_core.py algo.iterations=10 algo.trainable=expert task.task_ids=[3,4]
    MUJOCO_GL=egl .venv/bin/python 7_train_with_rl_core.py task.env=libero task.suite=libero_spatial \
        task.task_ids=[0] features.enable_parallel_envs=true env.runner.num_envs=2 env.runner.max_steps=20 \
        algo.iterations=1 algo.num_groups=1 algo.group_size=2 task.eval_states=1   # tiny random pi0: smoke run
    # real weights on a GPU: add task.checkpoint=ckpts/pi0_libero device=cuda
"""

from __future__ import annotations

from pi0.errors import run_cli
from pi0.ript.config import StageRules
from pi0.ript.utils.train_loop import cli_main

RULES = StageRules("7_train_with_rl_core.py", single_process=True, fixed={
    "features.enable_smart_sampling": (False, "dynamic sampling and the init-state history are stage 8: "
                                              "8_train_with_epochs.py"),
    "algo.opt.epochs": (1, "stage 7 makes one update pass per iteration; epochs are stage 8: 8_train_with_epochs.py"),
})


def main(argv: list[str] | None = None) -> list[dict]:
    """Load + validate the config, check stage 7's rules, train."""
    return cli_main(argv, "stage7_rl_core", __doc__, RULES)


if __name__ == "__main__":
    run_cli(main)
