r"""Stage 2: evaluate pi0 on the real LIBERO benchmark (success rate per task and suite, videos, debug sessions).

Adds: closed-loop evaluation on LIBERO through openpi's exact pi0_libero pipeline, with subprocess env workers
and batched inference (the shared runner core). Default policy: the tiny embedded model (its success rate is 0;
it exercises the whole path). Results go to <out_dir>/results.json, videos to <out_dir>/videos/.

    MUJOCO_GL=egl .venv/bin/python 2_test_pi0_on_libero.py --suite libero_spatial --task_ids 0 1 --num_trials 2
    MUJOCO_GL=egl .venv/bin/python 2_test_pi0_on_libero.py --checkpoint ckpts/pi0_libero --suite libero_10 \
        --num_trials 50 --num_envs 4 --device cuda --debug
    # several GPUs / nodes: each rank evaluates its share of the tasks and writes <out_dir>/rank<k>/results.json
    torchrun --nproc_per_node 4 2_test_pi0_on_libero.py --checkpoint ckpts/pi0_libero --suite libero_90
    # openpi-exact: openpi's env seeding / episode order (fixture poses as openpi's) and its bf16-rounded weights
    MUJOCO_GL=egl .venv/bin/python 2_test_pi0_on_libero.py --checkpoint ckpts/pi0_libero --suite libero_10 \
        --openpi_exact --openpi_bf16_params --seed 7
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402

from pi0.evaluation.libero_eval import EvalConfig, check_tasks, evaluate_libero  # noqa: E402
from pi0.errors import require_path, run_cli  # noqa: E402
from pi0.models.init import round_params_  # noqa: E402
from pi0.policies import load_policy, model_type_of  # noqa: E402
from pi0.policies.presets import tiny_policy  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config(EvalConfig):
    """Stage 2 options: the policy, plus every pi0.evaluation.libero_eval.EvalConfig field (suite, task_ids, num_trials, ...)."""

    checkpoint: str = ""  # policy directory (ours, openpi-PyTorch, RLinf, LeRobot); "" = tiny embedded default
    tokenizer: str = ""  # openpi-PyTorch / RLinf / LeRobot directories: PaliGemma's sentencepiece model
    norm_stats: str = ""  # ... their norm_stats.json when the directory has none
    openpi_config: str = ""  # ... the openpi TrainConfig preset (pi0.5 needs one; e.g. pi05_libero)
    device: str = "cpu"
    dtype: str = ""  # "" = as saved; "float32" | "bfloat16"
    openpi_bf16_params: bool = False  # round the weights to bf16 as unmodified openpi serving does


def main(argv: list[str] | None = None) -> dict:
    """Check the request, load the policy, evaluate, print the table."""
    cfg = parse_config(Config, argv, __doc__)
    ev = EvalConfig(**{f.name: getattr(cfg, f.name) for f in fields(EvalConfig)})
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tasks = [t for t, _, _ in check_tasks(ev.suite, ev.task_ids, ev.num_trials)]  # fail fast, before loading
    if cfg.checkpoint:
        require_path(cfg.checkpoint, "checkpoint", "give a policy directory: ours (convert_pi0_to_hf_lerobot.py), "
                     "openpi-PyTorch, RLinf or LeRobot", True)
        model_type_of(cfg.checkpoint)  # an unreadable layout stops here, before any env starts
    if world > 1:  # each rank evaluates every world-th task
        ev.task_ids, ev.out_dir = tasks[rank::world], f"{ev.out_dir}/rank{rank}"
        if not ev.task_ids:
            return {}
    overrides = {"dtype": cfg.dtype} if cfg.dtype else {}
    if cfg.checkpoint:  # pi0 or pi0-FAST (dispatch on config.json's model_type)
        if cfg.openpi_bf16_params:
            overrides["openpi_bf16_params"] = True
        policy = load_policy(cfg.checkpoint, device=cfg.device, tokenizer=cfg.tokenizer or None,
                             norm_stats=cfg.norm_stats or None, openpi_config=cfg.openpi_config or None, **overrides)
    else:
        policy = tiny_policy().to(cfg.device)
        if cfg.openpi_bf16_params:
            round_params_(policy.model, torch.bfloat16)
    results = evaluate_libero(policy, ev)
    for t, r in results["per_task"].items():
        print(f"task {t:>2}: {r['successes']:>3}/{r['episodes']:<3} = {r['success_rate']:.1%}  {r['language']}")
    print(f"{ev.suite}: success rate {results['success_rate']:.1%} over {results['num_episodes']} episodes "
          f"({results['wall_time_s']:.0f}s, {results['env_steps_per_s']:.1f} env steps/s) -> {ev.out_dir}/results.json")
    return results


if __name__ == "__main__":
    run_cli(main)
