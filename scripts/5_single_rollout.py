"""Stage 5: one closed-loop episode with pi0: action chunking + replanning, recorded as a video.

Adds: the policy in the loop. pi0 predicts a 50-step chunk, the first `replan_steps` actions are executed, then it
replans (openpi's LIBERO loop), through the shared runner core with one in-process env; every step is rendered
for the video.

    MUJOCO_GL=egl .venv/bin/python scripts/5_single_rollout.py --suite libero_spatial --task_id 0 --init_state_id 0
    .venv/bin/python scripts/5_single_rollout.py --env arena --task_id 2          # the fast built-in env
    MUJOCO_GL=egl .venv/bin/python scripts/5_single_rollout.py --checkpoint ckpts/pi0_libero --device cuda
(Single process; no torchrun.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402

from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.policies.presets import tiny_policy  # noqa: E402
from pi0.envs import make_env_spec  # noqa: E402
from pi0.policies.libero import Pi0ChunkPolicy  # noqa: E402
from pi0.rollout import RolloutRunner, libero_runner_config  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402
from pi0.utils.video import write_video  # noqa: E402


@dataclass
class Config:
    """Stage 5 options."""

    env: str = "libero"  # "libero" | "arena"
    suite: str = "libero_spatial"
    task_id: int = 0
    init_state_id: int = 0
    checkpoint: str = ""  # "" = tiny embedded default
    device: str = "cpu"
    replan_steps: int = 5
    max_steps: int = 0  # 0 = the env's own limit
    seed: int = 7
    out_dir: str = "outputs/stage5_single_rollout"


def main(argv: list[str] | None = None) -> dict:
    """Run one episode, write its video, print the outcome."""
    cfg = parse_config(Config, argv, __doc__)
    spec = make_env_spec(cfg.env, cfg.suite, cfg.task_id)  # validates env / suite before loading anything
    policy = (PI0Policy.from_pretrained(cfg.checkpoint, device=cfg.device) if cfg.checkpoint
              else tiny_policy().to(cfg.device))
    chunk_policy = Pi0ChunkPolicy(policy, torch.Generator().manual_seed(cfg.seed))
    run_cfg = libero_runner_config(num_envs=1, use_subprocess=False, replan_steps=cfg.replan_steps,
                                   max_steps=cfg.max_steps or None, record_video=True, video_every_step=True)
    with RolloutRunner(spec, chunk_policy, run_cfg) as runner:
        (ep,) = runner.run([(cfg.task_id, cfg.init_state_id)])
    name = f"{cfg.env}_{cfg.suite if cfg.env == 'libero' else 'arena'}_task{cfg.task_id}_init{cfg.init_state_id}"
    video = write_video(f"{cfg.out_dir}/{name}_{'success' if ep.success else 'failure'}.mp4", ep.frames or [], fps=20)
    print(f"'{ep.prompt}': {'SUCCESS' if ep.success else 'failure'} after {ep.length} steps, "
          f"{ep.num_decisions} policy calls (replan every {cfg.replan_steps}) -> {video}")
    return {"success": ep.success, "length": ep.length, "video": str(video)}


if __name__ == "__main__":
    main()
