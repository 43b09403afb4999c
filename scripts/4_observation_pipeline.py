"""Stage 4: what the policy sees. Saves and shows every step of openpi's pi0_libero observation pipeline.

Adds: the observation transforms between the simulator and pi0 (rotate 180, resize_with_pad to 224, 8-D state
from eef pose + axis-angle + gripper, z-score + pad to 32, PaliGemma tokenization), for one task and init state.
Writes raw / upright / processed / model-input PNGs, a side-by-side pipeline.png and pipeline.json.

    MUJOCO_GL=egl .venv/bin/python scripts/4_observation_pipeline.py --suite libero_spatial --task_id 0 --init_state_id 0
    MUJOCO_GL=egl .venv/bin/python scripts/4_observation_pipeline.py --checkpoint ckpts/pi0_libero   # real norm stats
(Single process; no torchrun.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")

from pi0.evaluation.debug import save_observation_pipeline  # noqa: E402
from pi0.envs.libero_env import LiberoEnv  # noqa: E402
from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.policies.presets import tiny_policy  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config:
    """Stage 4 options."""

    suite: str = "libero_spatial"
    task_id: int = 0
    init_state_id: int = 0
    checkpoint: str = ""  # PI0Policy directory; "" = tiny embedded default
    out_dir: str = "outputs/stage4_observation_pipeline"


def main(argv: list[str] | None = None) -> dict:
    """Reset the env to the init state, run the pipeline once, save and print what the policy sees."""
    cfg = parse_config(Config, argv, __doc__)
    policy = PI0Policy.from_pretrained(cfg.checkpoint) if cfg.checkpoint else tiny_policy()
    env = LiberoEnv(cfg.suite, cfg.task_id, init_state_id=cfg.init_state_id)
    try:
        obs, _ = env.reset(options={"init_state_id": cfg.init_state_id})
        out = f"{cfg.out_dir}/{cfg.suite}_task{cfg.task_id}_init{cfg.init_state_id}"
        summary = save_observation_pipeline(out, policy, obs, env.prompt)
    finally:
        env.close()
    print(json.dumps({k: summary[k] for k in ("prompt", "client_state_8", "token_pieces", "image_masks")}, indent=1))
    print(f"saved the pipeline to {out}/pipeline.png and pipeline.json")
    return summary


if __name__ == "__main__":
    main()
