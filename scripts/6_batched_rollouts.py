r"""Stage 6: several episodes at once, with batched inference over subprocess env workers.

Adds: parallelism. N env workers (spawned processes, no model inside) step in parallel; at each round the
observations of every env at a decision point go through ONE batched pi0 call in this process; K rollouts per
init state form a group (what RLOO needs). Prints per-episode outcomes, batch sizes, throughput and worker RSS.

    MUJOCO_GL=egl .venv/bin/python scripts/6_batched_rollouts.py --suite libero_spatial --task_ids 0 --group_size 2 \
        --num_envs 2 --max_steps 40
    .venv/bin/python scripts/6_batched_rollouts.py --env arena --task_ids 0 1 2 3 --group_size 4 --num_envs 4
    # one runner per rank (each rank takes every world-th init state):
    torchrun --nproc_per_node 2 scripts/6_batched_rollouts.py --env arena --num_envs 2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.policies.presets import tiny_policy  # noqa: E402
from pi0.envs import make_env_spec  # noqa: E402
from pi0.policies.libero import Pi0ChunkPolicy  # noqa: E402
from pi0.rollout import RolloutRunner, ript_vla_runner_config  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config:
    """Stage 6 options."""

    env: str = "libero"  # "libero" | "arena"
    suite: str = "libero_spatial"
    task_ids: list[int] = field(default_factory=lambda: [0])
    init_states: int = 1  # init states per task (0..n-1)
    group_size: int = 2  # K rollouts per init state
    num_envs: int = 2
    checkpoint: str = ""
    device: str = "cpu"
    max_steps: int = 0  # 0 = the env's limit
    seed: int = 7


def main(argv: list[str] | None = None) -> list:
    """Run the groups and report."""
    cfg = parse_config(Config, argv, __doc__)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    spec = make_env_spec(cfg.env, cfg.suite, cfg.task_ids[0])
    states = [(t, i) for t in cfg.task_ids for i in range(cfg.init_states)][rank::world]
    policy = (PI0Policy.from_pretrained(cfg.checkpoint, device=cfg.device) if cfg.checkpoint
              else tiny_policy().to(cfg.device))
    chunk_policy = Pi0ChunkPolicy(policy, torch.Generator().manual_seed(cfg.seed + rank))
    run_cfg = ript_vla_runner_config(num_envs=cfg.num_envs, group_size=cfg.group_size, max_steps=cfg.max_steps or None,
                                     store_images=False, progress=True)
    with RolloutRunner(spec, chunk_policy, run_cfg) as runner:
        episodes = runner.run(states)
        rss = runner.vec_env.worker_rss()
    st = runner.last_stats
    for ep in episodes:
        print(f"[rank {rank}] task {ep.task_id} init {ep.init_state_id} k={ep.sample_index}: "
              f"{'success' if ep.success else 'failure'}, {ep.length} steps, {ep.num_decisions} decisions")
    print(f"[rank {rank}] {len(episodes)} episodes, {st.policy_calls} batched policy calls "
          f"(mean batch {st.mean_batch_size:.2f}, max {max(st.batch_sizes, default=0)}), "
          f"{st.steps_per_second:.1f} env steps/s, policy time {st.policy_time:.1f}s of {st.wall_time:.1f}s")
    print(f"[rank {rank}] worker RSS (MB): {[round(r / 2**20) for r in rss]}, mean {np.mean(rss) / 2**20:.0f}")
    return episodes


if __name__ == "__main__":
    main()
