r"""Stage 8: RIPT with epochs and batched updates, dynamic sampling and an init-state history.

Adds to stage 7: several epochs of minibatched updates per iteration (algo.opt.epochs, minibatch_size,
grad_accum_steps, max_grad_norm clipping; non-finite steps are skipped and counted); smart sampling
(features.enable_smart_sampling): dynamic sampling (groups whose K rewards are all equal carry no signal and are
dropped, and collection goes on until algo.num_groups informative groups are kept) and an init-state history (a
state whose last K rollouts all succeeded is skipped, then re-probed after features.history_reprobe_after skips;
written to <run>/history.json every iteration and restored by --resume); bounded collection (after
algo.max_collect_attempts rounds, or when every state is solved, it stops with a message instead of looping
forever); evaluation on held-out init states every algo.eval_every iterations.

Same loader as stages 7 and 9: --config_path takes a bundled preset or a YAML file (default: stage8_epochs, a tiny
arena run of well under a minute on CPU), key=value arguments override it, an unknown key or bad value is one
line on stderr with exit 2, and the resolved config is saved as <run>/config.yaml. Single-process (torchrun:
stages 10-11). Writes <logging.out_dir>/<logging.run_name>/: config.yaml, history.json, tb/, curve.json,
success.png, checkpoints/, final/.

    .venv/bin/python 8_train_with_epochs.py                                    # arena, tiny warm-started pi0
    .venv/bin/python 8_train_with_epochs.py algo.iterations=10 algo.opt.epochs=4 algo.opt.grad_accum_steps=4
    .venv/bin/python 8_train_with_epochs.py algo.iterations=20 --resume         # continue the run (history too)
    MUJOCO_GL=egl .venv/bin/python 8_train_with_epochs.py task.env=libero task.suite=libero_spatial \
        task.task_ids=[0] features.enable_parallel_envs=true env.runner.num_envs=2 env.runner.max_steps=20 \
        algo.iterations=1 algo.num_groups=1 algo.group_size=2 task.eval_states=1   # tiny random pi0: smoke run
    # real weights on a GPU: add task.checkpoint=ckpts/pi0_libero device=cuda
"""

from __future__ import annotations

from pi0.errors import run_cli
from pi0.ript.config import StageRules
from pi0.ript.utils.train_loop import cli_main

RULES = StageRules("8_train_with_epochs.py", single_process=True)


def main(argv: list[str] | None = None) -> list[dict]:
    """Load + validate the config, train."""
    return cli_main(argv, "stage8_epochs", __doc__, RULES)


if __name__ == "__main__":
    run_cli(main)
