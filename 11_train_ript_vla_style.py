r"""Stage 11: the RIPT-VLA-style loop on the parallel runner, from YAML, single process or torchrun.

Adds to stage 10's job the RIPT-VLA runner layout as its default (preset stage11_ript_vla): subprocess envs
(features.enable_parallel_envs), the grouped schedule with num_groups x group_size envs so the K rollouts of a
state advance together and share batched policy calls with per-env action queues (features.use_ript_vla_runner),
and smart sampling (dynamic sampling + init-state history, features.enable_smart_sampling). Writes under
runs/<run_name>/: TensorBoard logs, curve.json, success.png, rollout videos, checkpoints, final/, config.yaml.
This is `make run`: a tiny pi0 SFT'd to a converged few-shot plateau on the arena (cached under runs/cache), then
LOOP (algo.objective=ppo, with the flow-matching loss on the start's demos added to each minibatch: algo.demo_coef)
and continued SFT from it side by side (baseline.sft, pi0.ript.sft_baseline), both scored on the same held-out
episodes: success.png with both curves and summary.json. About 14 minutes on 2 CPU cores. With task.checkpoint (no
demos), set algo.demo_coef=0.

    .venv/bin/python 11_train_ript_vla_style.py                      # = make run
    torchrun --nproc_per_node=2 11_train_ript_vla_style.py --config_path debug_distributed_train
    .venv/bin/python 11_train_ript_vla_style.py --config_path libero_spatial task.checkpoint=ckpts/pi0_libero
"""

from __future__ import annotations

from pi0.errors import run_cli
from pi0.ript.utils.train_loop import cli_main


def main(argv: list[str] | None = None) -> list[dict]:
    """Load + validate the config, train."""
    return cli_main(argv, "stage11_ript_vla", __doc__)


if __name__ == "__main__":
    run_cli(main)
